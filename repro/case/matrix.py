"""The parametrized case set, expectations (positive and negative controls), and a parallel matrix run."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

from repro.case.descriptors import AttnConfig
from repro.case.poison import DEFAULT_POISON
from repro.case.scenarios import DEFAULT_PAIR, FRESH, PAIR, STALE, V2, pair_descriptors
from repro.case.spec import CaseResult, CaseSpec, SmConfig
from repro.contract.verdicts import SKIP
from repro.errors import ConfigError
from repro.judge.expectations import expectation, positive_control
from repro.judge.policy import disagrees, is_positive, problem, satisfies
from repro.run.memory import MemoryBudget, case_bytes
from repro.run.mps_cases import PER_CASE, run_mps_cases

DEFAULT_SMS = ("sm_margin:16", "mps:16", "full")  # the matrix's SM restrictions (`matrix --sms`)


@dataclass(frozen=True)
class MatrixOptions:
    backends: tuple[str, ...] = ("upstream", "vllm")
    strategies: tuple[str, ...] = (STALE, FRESH)
    sms: tuple[str, ...] = DEFAULT_SMS
    modes: tuple[str, ...] = ("eager", "graph")
    splits: tuple[int, ...] = (32, 0)
    poison: str | None = DEFAULT_POISON
    sanitizer: bool = False
    timeout_s: float = 120.0
    repeat: int = 1
    scenario: str = V2
    cfg: AttnConfig = AttnConfig()
    pair: tuple[str, str] | None = None  # the pair scenario's (built for, launched); None: DEFAULT_PAIR


def expected_of(spec: CaseSpec, res: CaseResult) -> str:
    """The expectation a result was held to: the stored one (records keep theirs), else today's (attached once)."""
    if res.expected is None:
        res.expected = expectation(spec)
    return res.expected


def attach_expectations(results: Iterable[tuple[CaseSpec, CaseResult]], expected: dict[str, str]) -> None:
    for s, r in results:
        if r.expected is None:
            r.expected = expected.get(s.case_id) or expectation(s)


def run_order(spec: CaseSpec) -> int:
    """Positive controls first, eager ones (a fault shows at the first launch) before graphs: a blind harness shows up
    in the first seconds."""
    return 0 if positive_control(spec) and spec.mode == "eager" else 1 if positive_control(spec) else 2


def build_specs(opts: MatrixOptions) -> list[CaseSpec]:
    for axis in ("backends", "strategies", "sms", "modes", "splits"):
        values = getattr(opts, axis)
        dups = sorted({str(v) for v in values if values.count(v) > 1})
        if dups:
            raise ConfigError(f"--{axis}: {', '.join(dups)} given twice (one case id each; use --repeat to run again)")
    pair = None
    if opts.scenario == PAIR:
        pair = opts.pair or DEFAULT_PAIR
        pair_descriptors(pair, opts.cfg)  # a bad or too large descriptor: one line, before any case runs
    elif opts.pair:
        raise ConfigError(f"--built-for and --launched describe the pair scenario, not --scenario {opts.scenario}")
    specs = []
    for backend in opts.backends:
        for strategy in opts.strategies:
            for sm in opts.sms:
                for mode in opts.modes:
                    for splits in opts.splits:
                        cfg = opts.cfg.with_(num_splits=splits)
                        specs.append(
                            CaseSpec(
                                backend,
                                strategy,
                                mode,
                                opts.scenario,
                                sm=SmConfig.parse(sm),
                                cfg=cfg,
                                poison=opts.poison,
                                sanitizer=opts.sanitizer,
                                pair=pair,
                                timeout_s=opts.timeout_s,
                            )
                        )
    if not specs:
        raise ConfigError("the matrix is empty: every axis needs at least one value")
    ids = [s.case_id for s in specs]
    if len(set(ids)) != len(ids):  # e.g. sm_margin:132 and full on an H200 differ in name only
        raise ConfigError(f"two cases share one id: {next(i for i in ids if ids.count(i) > 1)}")
    specs.sort(key=run_order)

    return [replace(s, rep=k) for s in specs for k in range(opts.repeat)]


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
