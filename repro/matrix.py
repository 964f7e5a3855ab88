"""The parametrized case set, expectations (positive and negative controls), and a parallel matrix run."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, replace
from pathlib import Path

from repro.case import CLEAN, CRASH, FAULTS, HANG, OOB, SKIP, CaseResult, CaseSpec, SmConfig
from repro.descriptors import AttnConfig, ConfigError
from repro.runner import run_case
from repro.scenarios import FRESH, STALE, V2
from repro.smcontrol import Unavailable, maybe_mps

DEFAULT_SMS = ("sm_margin:16", "mps:16", "full")
DEFAULT_POISON = "int-max"
MEMORY_FAULTS = (OOB, CRASH, HANG)


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


MEASURED_SHAPE = AttnConfig()  # the shape the fault was measured with (results/h200-*)


def expectation(spec: CaseSpec) -> str:
    """`fault`: a positive control that must show a memory fault (vLLM's kernels and parameters, 16 SMs, poisoned
    padding, the measured shape: faulted in every recorded run); `detected`: stale, so at least wrong output or the
    capture audit; `clean`: fresh."""
    if spec.strategy == FRESH:
        return "clean"
    if (
        spec.cfg == MEASURED_SHAPE
        and spec.scenario != "pair"
        and spec.backend == "vllm"
        and spec.poison == "int-max"
        and spec.mode == "eager"
        and spec.sm.kind in ("sm_margin", "mps", "mig")
        and (spec.sm.sms or 16) <= 16
    ):
        return "fault"
    return "detected"


def meets(expect: str, verdict: str) -> bool | None:
    """None when the case did not run (skip): neither pass nor fail."""
    if verdict == SKIP:
        return None
    if expect == "clean":
        return verdict == CLEAN
    if expect == "fault":
        return verdict in MEMORY_FAULTS
    return verdict in FAULTS


def build_specs(opts: MatrixOptions) -> list[CaseSpec]:
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
                                timeout_s=opts.timeout_s,
                            )
                        )
    if not specs:
        raise ConfigError("the matrix is empty: every axis needs at least one value")
    # Positive controls first: a blind harness shows up in the first minute.
    specs.sort(key=lambda s: {"fault": 0, "detected": 1, "clean": 2}[expectation(s)])
    return [replace(s, rep=k) for s in specs for k in range(opts.repeat)]


@dataclass
class MatrixRun:
    results: list[tuple[CaseSpec, CaseResult]]
    wall_s: float
    first_positive_s: float | None
    source: str = "gpu"  # gpu: kernels ran; model: the CPU model predicted the verdicts

    def failures(self) -> list[tuple[CaseSpec, CaseResult]]:
        return [(s, r) for s, r in self.results if meets(expectation(s), r.verdict) is False]

    def blind_controls(self) -> list[tuple[CaseSpec, CaseResult]]:
        return [(s, r) for s, r in self.failures() if expectation(s) != "clean"]


def run_matrix(
    specs: Iterable[CaseSpec],
    log_dir: str | Path,
    jobs: int = 4,
    progress: Callable[[int, int, CaseSpec, CaseResult], None] | None = None,
) -> MatrixRun:
    """Run cases in parallel processes; MPS cases afterwards, one at a time, each under a daemon of its own."""
    specs = list(specs)
    t0 = time.time()
    first_pos: list[float] = []
    done: list[tuple[CaseSpec, CaseResult]] = []
    # MPS: one client's fatal fault takes the server down with every client attached, so MPS cases run one at a
    # time, each under a daemon of its own (measured on the H200: concurrent clients failed with "device busy").
    plain = [s for s in specs if s.sm.kind != "mps"]
    mps_cases = [s for s in specs if s.sm.kind == "mps"]

    def record(s: CaseSpec, r: CaseResult) -> None:
        done.append((s, r))
        if not first_pos and expectation(s) != "clean" and r.verdict != SKIP:
            first_pos.append(time.time() - t0)
        if progress:
            progress(len(done), len(specs), s, r)

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futs = {pool.submit(run_case, s, log_dir): s for s in plain}
        for f in as_completed(futs):
            record(futs[f], f.result())
    for s in mps_cases:
        try:
            with maybe_mps(True) as mps:
                r = run_case(s, log_dir, mps)
        except Unavailable as e:
            r = CaseResult.skipped(s, str(e))
        record(s, r)
    order = {id(s): k for k, s in enumerate(specs)}
    done.sort(key=lambda sr: order[id(sr[0])])
    return MatrixRun(done, round(time.time() - t0, 2), round(first_pos[0], 2) if first_pos else None)


def text_progress(n: int, total: int, spec: CaseSpec, res: CaseResult) -> None:
    width = 24
    fill = int(width * n / total)
    sys.stderr.write(
        f"[{'#' * fill}{'.' * (width - fill)}] {n}/{total} {res.verdict:<12} {spec.case_id} ({res.wall_s:.0f}s)\n"
    )
    sys.stderr.flush()
