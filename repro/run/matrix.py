"""A matrix run: its cases in parallel processes (the MPS cases under their daemons), each held to its expectation
(positive and negative controls), the run's failures, blind controls and disagreements (MatrixRun). Its cases:
repro.case.matrix."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

from repro.case.spec import CaseResult, CaseSpec, positive_control
from repro.contract.verdicts import SKIP
from repro.judge.expectations import expectation
from repro.judge.policy import disagrees, is_positive, problem, satisfies
from repro.run.memory import MemoryBudget, case_bytes
from repro.run.mps_cases import PER_CASE, run_mps_cases


def expected_of(spec: CaseSpec, res: CaseResult) -> str:
    """The expectation a result was held to: the stored one (records keep theirs), else today's (attached once)."""
    if res.expected is None:
        res.expected = expectation(spec)
    return res.expected


def attach_expectations(results: Iterable[tuple[CaseSpec, CaseResult]], expected: dict[str, str]) -> None:
    for s, r in results:
        if r.expected is None:
            r.expected = expected.get(s.case_id) or expectation(s)


@dataclass
class MatrixRun:
    results: list[tuple[CaseSpec, CaseResult]]
    wall_s: float
    first_positive_s: float | None
    source: str = "gpu"  # gpu: kernels ran; model: the CPU model predicted the verdicts
    first_positive_case: str | None = None  # the case behind first_positive_s
    started_at: float | None = None  # when the run started (epoch s)
    setup_s: float | None = None  # from the command's start to the run's (set by the command that ran it)

    def failures(self) -> list[tuple[CaseSpec, CaseResult]]:
        """Cases whose verdict missed the expectation stored in their result."""
        return [(s, r) for s, r in self.results if satisfies(expected_of(s, r), r.verdict) is False]

    def blind_controls(self) -> list[tuple[CaseSpec, CaseResult]]:
        """Positive controls (by the expectation stored in their result) that missed it WITHOUT kernel evidence
        (clean, an audit alone where the kernels had to show it, an error): there this environment did not see the
        bug. The policy's own judgement (repro.judge.policy.problem), over the cases that ran (a skip is no miss)."""
        return [
            (s, r)
            for s, r in self.failures()
            if is_positive(expected_of(s, r)) and problem(expected_of(s, r), r.verdict) is not None
        ]

    def disagreements(self) -> list[tuple[CaseSpec, CaseResult]]:
        """Positive controls that missed their expectation WITH kernel evidence of another kind (wrong-output where
        `fault` was expected): the bug was detected, the expectation named another kind (repro.judge.policy.disagrees,
        the gate's disagreement list)."""
        return [(s, r) for s, r in self.failures() if disagrees(expected_of(s, r), r.verdict)]


def run_matrix(
    specs: Iterable[CaseSpec],
    log_dir: str | Path,
    jobs: int = 4,
    progress: Callable[[int, int, CaseSpec, CaseResult], None] | None = None,
    executor=None,
    mps_daemon: str = PER_CASE,
    memory: MemoryBudget | None | str = "free GPU",
) -> MatrixRun:
    """Run cases in parallel processes, and the MPS cases under MPS daemons as `mps_daemon` says (repro.run.mps_cases).
    per-case: the MPS cases after the others, each under a daemon of its own. shared: one daemon, its cases beside
    the others (an MPS client and plain CUDA processes ran side by side on the H200: results/h200-mps-probe). Every
    case process holds its share of `memory` (repro.run.memory: by default the GPU's free memory; None: no limit)
    while it runs, so `jobs` cases at a time become fewer where their KV caches are large."""
    from repro.run.runner import (  # here: the CPU model imports this module
        memcheck_launch_env,
        run_case,
        set_aside_logs,
    )

    specs = list(specs)
    t0 = time.time()
    budget = MemoryBudget.of_free_gpu() if memory == "free GPU" else memory

    def run_one(s: CaseSpec, daemon) -> CaseResult:
        if budget is None:
            return run_case(s, log_dir, daemon, executor)
        with budget.hold(case_bytes(s.cfg.device_bytes())):
            return run_case(s, log_dir, daemon, executor)

    expected: dict[str, str] = {}
    # the controls' expectations, beside the cases (the CPU model imports torch: seconds no case need wait for)
    expecting = threading.Thread(target=lambda: expected.update({s.case_id: expectation(s) for s in specs}))
    expecting.start()
    if executor is not None:
        executor.prepare(specs, memcheck_launch_env())  # memcheck processes start importing now
    first_pos: list[tuple[float, str]] = []
    done: list[tuple[CaseSpec, CaseResult]] = []
    lock = threading.Lock()
    plain = [s for s in specs if s.sm.kind != "mps"]
    mps_cases = [s for s in specs if s.sm.kind == "mps"]
    log_dir = Path(log_dir)

    def record(s: CaseSpec, r: CaseResult) -> None:
        with lock:
            done.append((s, r))
            if not first_pos and positive_control(s) and r.verdict != SKIP:
                first_pos.append((time.time() - t0, s.case_id))
            if progress:
                progress(len(done), len(specs), s, r)

    def mps_group() -> None:
        for s, r in run_mps_cases(
            mps_cases,
            run_one,
            mps_daemon,
            jobs,
            may_share=lambda s: not positive_control(s),
            before_rerun=lambda s, attempt: set_aside_logs(log_dir, s.case_id, attempt),  # kept beside the rerun's
        ):
            record(s, r)

    beside = mps_daemon != PER_CASE and mps_cases
    try:
        with ThreadPoolExecutor(max_workers=max(1, jobs) + (1 if beside else 0)) as pool:
            group = pool.submit(mps_group) if beside else None
            futs = {pool.submit(run_one, s, None): s for s in plain}
            for f in as_completed(futs):
                record(futs[f], f.result())
            if group is not None:
                group.result()
        if not beside:
            mps_group()
    finally:
        if executor is not None:
            executor.close()  # no memcheck process started ahead outlives the run
    order = {id(s): k for k, s in enumerate(specs)}
    done.sort(key=lambda sr: order[id(sr[0])])
    expecting.join()
    attach_expectations(done, expected)
    first = first_pos[0] if first_pos else (None, None)
    return MatrixRun(
        done,
        round(time.time() - t0, 2),
        round(first[0], 2) if first[0] is not None else None,
        first_positive_case=first[1],
        started_at=t0,
    )


def text_progress(n: int, total: int, spec: CaseSpec, res: CaseResult) -> None:
    width = 24
    fill = int(width * n / total)
    sys.stderr.write(
        f"[{'#' * fill}{'.' * (width - fill)}] {n}/{total} {res.verdict:<12} {spec.case_id} ({res.wall_s:.0f}s)\n"
    )
    sys.stderr.flush()
