"""How the MPS cases of a matrix share MPS daemons.

Under MPS one client's fatal GPU fault is delivered to every client attached to the same server, and the server
takes no new client until all of them have exited (NVIDIA's MPS guide, "error containment"); two MPS servers cannot
share a GPU. So a case's verdict must come from a run in which no other client could have faulted it:

- `per-case`: every MPS case alone under a daemon of its own, started and stopped around it (the old path).
- `shared`: one daemon for the whole MPS group. Cases that may fault run one at a time under it; cases expected
  clean run `jobs` at a time as concurrent clients. In a batch only verdicts no other client can cause are kept
  (TRUSTED_IN_BATCH: clean, skip, and oob, memcheck's finding in the client's own kernels); when a batch of several
  has any other verdict, each such case reruns alone under a daemon of its own, after the shared one stopped. A case
  run alone under the shared daemon that ended in a harness error (the server still recovering from the previous
  client's fault, say) reruns the same way; but one the server refused (a client whose process never ran: the server
  takes none while it recovers from the previous client's fault) first runs again under the same daemon after a
  pause, up to len(REFUSED_WAITS_S) times. Before each case that runs alone and each batch, the shared daemon is
  asked whether its server is still recovering from a fault (MpsDaemon.wait_ready), so that refusals are rare. The
  rerun's verdict is the case's; its reason keeps the first attempt's.
  Measured on the H200 (results/h200-memcheck-batched): 16 memcheck MPS cases, stale ones included, as batches of
  12 clients: 11 had to rerun alone (a neighbour's memcheck stop reached them as an error, a crash or a failed
  launch), so cases that may fault are not batched, under memcheck either.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

from repro.case.spec import RERUN_ALONE, CaseResult, CaseSpec
from repro.contract.verdicts import CLEAN, ERROR, OOB, SKIP
from repro.errors import Unavailable
from repro.judge.classify import refused
from repro.run.smcontrol import MpsDaemon

PER_CASE, SHARED = "per-case", "shared"
MPS_DAEMON_POLICIES = (PER_CASE, SHARED)
DEFAULT_MPS_DAEMON = SHARED

# A client that finished clean, skipped, or had memcheck's instrumentation catch its own access: no other client's
# fault can produce these. Anything else in a batch (a fault code, a hang, an error) may have come from a neighbour.
TRUSTED_IN_BATCH = (CLEAN, SKIP, OOB)

# Pauses before a refused case runs again under the same daemon (the H200's server took 3 of 8 stale memcheck cases'
# successors only after a rerun: results/h200-memcheck-executors).
REFUSED_WAITS_S = (0.5, 1.0, 2.0, 4.0)

RunOne = Callable[[CaseSpec, MpsDaemon], CaseResult]


def run_mps_cases(
    specs: list[CaseSpec],
    run_one: RunOne,
    policy: str = PER_CASE,
    jobs: int = 4,
    may_share: Callable[[CaseSpec], bool] = lambda s: False,
    daemon_factory: Callable[[], MpsDaemon] = MpsDaemon,
    before_rerun: Callable[[CaseSpec, str], None] = lambda s, attempt: None,
    refused_waits: Sequence[float] = REFUSED_WAITS_S,
    final: Callable[[CaseResult], bool] = lambda r: False,
    alone_first: bool = True,
) -> Iterator[tuple[CaseSpec, CaseResult]]:
    """Yield (spec, result) for every MPS case, in the order the verdicts become final. `before_rerun(spec, name)`
    is called for a case about to run again, with a name for the attempt before (to keep its logs). `final(result)`:
    an error no neighbour can have caused and no rerun can change (the vLLM gate's failed platform check): kept.
    `alone_first`: the cases that run alone before the shared batches (the matrix: a positive control's evidence
    first), or after them (the vLLM gate: the builds under test and the references, concurrent and quick, before
    controls that take minutes each, so that a run its --deadline cuts still has them)."""
    if policy not in MPS_DAEMON_POLICIES:
        raise ValueError(f"unknown MPS daemon policy {policy!r}; choose from {', '.join(MPS_DAEMON_POLICIES)}")
    if not specs:  # nothing to run: no daemon started
        return
    if policy == PER_CASE:
        for s in specs:
            yield s, _alone(s, run_one, daemon_factory)
        return
    alone = [s for s in specs if not may_share(s)]
    shared = [s for s in specs if may_share(s)]
    rerun: list[tuple[CaseSpec, str, str]] = []  # (case, why, a name for the attempt before)
    try:
        daemon = daemon_factory().start()
    except Unavailable as e:
        for s in specs:
            yield s, CaseResult.skipped(s, str(e))
        return

    def alone_part() -> Iterator[tuple[CaseSpec, CaseResult]]:
        for s in alone:
            waited, states = daemon.wait_ready()  # the previous case may have faulted the server
            r = run_one(s, daemon)
            if states:
                r.reason = f"{r.reason} (started after {waited:g} s waiting for the MPS server: {states[0]})".strip()
            refusals = []  # how long each refused attempt took
            for k, pause in enumerate(refused_waits):
                if not refused(r):
                    break
                refusals.append(f"{r.wall_s:.1f} s")
                before_rerun(s, f"refused{k + 1}")
                time.sleep(pause)
                r = run_one(s, daemon)
            if refusals:
                why = f"ran after {len(refusals)} refusal(s) ({', '.join(refusals)}) while the MPS server recovered"
                r.reason = f"{r.reason} ({why})".strip()
            if r.verdict == ERROR and not final(r):
                rerun.append((s, f"ended in an error under the shared MPS daemon: {r.reason[:160]}", "shared"))
            else:
                yield s, r

    def shared_part() -> Iterator[tuple[CaseSpec, CaseResult]]:
        size = max(1, jobs)
        for k in range(0, len(shared), size):
            batch = shared[k : k + size]
            daemon.wait_ready()
            with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                results = list(pool.map(lambda s: run_one(s, daemon), batch))
            suspect = [r.verdict not in TRUSTED_IN_BATCH and not final(r) for r in results]
            troubled = len(batch) > 1 and any(suspect)
            for s, r, doubt in zip(batch, results, suspect):
                if troubled and doubt:
                    rerun.append((s, f"{r.verdict} in a batch of {len(batch)} MPS clients: {r.reason[:160]}", "batch"))
                else:
                    yield s, r

    try:
        for part in (alone_part, shared_part) if alone_first else (shared_part, alone_part):
            yield from part()
    finally:
        daemon.stop()
    for s, why, attempt in rerun:
        before_rerun(s, attempt)
        r = _alone(s, run_one, daemon_factory)
        r.reason = f"{r.reason} (rerun alone: {why})".strip()
        r.flags.append(RERUN_ALONE)
        yield s, r


def _alone(spec: CaseSpec, run_one: RunOne, daemon_factory: Callable[[], MpsDaemon]) -> CaseResult:
    try:
        with daemon_factory() as daemon:
            return run_one(spec, daemon)
    except Unavailable as e:
        return CaseResult.skipped(spec, str(e))
