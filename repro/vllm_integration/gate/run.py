"""The vLLM gate's run (GateScheduler, through run_gate): every gate case (gate.case: a vLLM build x detection mode)
as its own process (gate.process, run_control) under a timeout, classified by the same verdict code as the
attention-layer cases and judged (gate.steps: annotation, the comparison with the build's own reference run in the same
SM configuration, coverage); non-MPS cases in parallel; MPS cases under a daemon owned by the run, the cases expected
clean as its concurrent clients, each control alone, a rerun alone under a daemon of its own (repro.run.mps_cases).
What the run holds and its outcome through the policy: gate.outcome (GateRun)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import NamedTuple

from repro.case.spec import PLATFORM_FAILED, CaseResult, SmConfig
from repro.contract.channel import path_for
from repro.contract.verdicts import CLEAN, ERROR
from repro.errors import ConfigError, Unavailable
from repro.run.memory import GIB, MemoryBudget
from repro.run.mps_cases import SHARED, run_mps_cases
from repro.run.runner import case_logs, device_sm_count, set_aside_logs
from repro.run.smcontrol import MpsDaemon, sm_refusal
from repro.vllm_integration.gate import placement
from repro.vllm_integration.gate.cache import GateCache, gpu_identity, keep_in_logs, kept_reference, ref_key
from repro.vllm_integration.gate.case import GateCase, case_env, persons_choices, plan, reference_for
from repro.vllm_integration.gate.judge import PLATFORM_CHECK, platform_failed
from repro.vllm_integration.gate.launch import FORK, Launcher, launcher_kind
from repro.vllm_integration.gate.methods import DEFAULT_METHOD
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.order import REF_SLOTS, case_order
from repro.vllm_integration.gate.outcome import GateRun
from repro.vllm_integration.gate.placement import DevicePool, GateDevice, case_gib, kind_of, main_kind, per_device_jobs
from repro.vllm_integration.gate.process import (
    SELF_CONTROL_ATTEMPTS,
    Attempt,
    attributed_beside,
    form_caught,
    result_line,
    retried,
    run_control,
    set_apart_not_applicable,
    skipped,
)
from repro.vllm_integration.gate.steps import finish, validate
from repro.vllm_integration.gate.stopping import results_in_order, stop_in_flight
from repro.vllm_integration.gate.worker import DEFAULT_COMPILE
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND
from repro.vllm_integration.plugin.inject import INJECTIONS
from repro.vllm_integration.releases.builds import VllmBuild


class _Ran(NamedTuple):
    """What a case's last process left beside its verdict, for GateScheduler.record."""

    logs: GateCase  # the case whose logs hold its records (a self control's later attempt, or the case itself)
    started: float
    attribution: tuple[GateCase, CaseResult] | None = None  # its launch-blocking rerun
    attempts: Sequence[tuple[GateCase, CaseResult]] = ()  # every attempt (run_control), the first included
    out: dict | None = None  # its RESULT record where no process left one (a kept reference, a skip); None: read it


@dataclass
class GateScheduler:
    """One gate run (its fields: run_gate's parameters) as its steps, called in this order: plan, launch, collect,
    judge, report. Every name a step reads was set by a step before it."""

    builds: list[VllmBuild]
    modes: tuple[GateMode, ...]
    log_dir: str | Path
    repeat: int = 1
    jobs: int = 3
    timeout_s: float = 300.0
    progress: Callable[[GateCase, CaseResult], None] | None = None
    cache: GateCache | None = None
    backends: tuple[str, ...] = (DEFAULT_BACKEND,)
    self_control: str = "under-test"
    devices: list[GateDevice] | None = None
    only: VllmBuild | None = None
    launcher: str | None = None
    deadline_s: float | None = None
    compile: str = DEFAULT_COMPILE
    keep_forkserver: float | None = None
    memory: MemoryBudget | None | str = "free GPU"
    methods: tuple[str, ...] = (DEFAULT_METHOD,)
    self_control_forms: tuple[str, ...] = INJECTIONS
    self_control_attempts: int | None = None
    cold_jobs: int | None = None
    control_kernels: bool = False

    def __post_init__(self) -> None:
        self.cases: list[GateCase] = []  # plan: the speculative cases, in their order
        self.refs: list[GateCase] = []  # plan: each case's reference, once
        self.skipped_na: list[tuple[GateCase, CaseResult]] = []  # plan: a method the build lacks (no process)
        self.run = GateRun()
        self.lock = threading.Lock()
        self.starts: dict[str, list[float]] = {}  # build label -> [first start, last end]
        self.outputs: dict[str, dict | None] = {}  # case id -> its RESULT record
        self.ran_last: dict[str, _Ran] = {}  # case id -> what its last process left beside its verdict
        # an MPS SM configuration and its torch -> (case id, why): the GPU computed bf16 products wrong there (24 and
        # 40 SMs); later cases in it are errors that say so, never processes (20-60 s each) that find it again
        self.broken: dict[tuple[SmConfig, str | None], tuple[str, str]] = {}
        self.done: dict[str, tuple[CaseResult, dict | None]] = {}  # finished reference's id -> result, RESULT record
        self.mps_failed: list[BaseException] = []
        self.launched: Launcher | None = None  # launch: how case processes start
        self.gpu = ""  # launch: the GPU's identity a kept reference is filed under
        self.pool: DevicePool | None = None  # launch: the devices given, one kind
        self.kind: tuple[str, int | None] | None = None  # launch: that kind
        self.workers = 1  # launch: cases at a time
        self.budget: MemoryBudget | None = None  # launch: the GPU memory each case holds its share of
        self.cold: placement.ColdSlots  # launch: how many cases compile on a build's cold caches at once
        # case id -> its slot's seconds: in this GPU's last run (launch; gate.order), in this run (record)
        self.measured, self.took = dict[str, float](), dict[str, float]()

    def __call__(self) -> GateRun:
        """Every step in order; whatever stops the run (a failed probe, Ctrl-C, an error) stops its forkservers."""
        self.plan()
        self.run.started_at = time.time()
        self.launched = Launcher(launcher_kind(self.launcher), self.log_dir, keep_s=self.keep_forkserver)
        try:
            self.launch()
            self.collect()
        finally:
            self.run.launches = self.launched.summary()
            self.launched.close()
        self.judge()
        return self.report()

    def plan(self) -> None:
        """The cases (plan), those of a method the build lacks set apart, an SM count the GPU cannot give refused,
        each case's reference once, every process's deadline."""
        if not self.builds:
            raise ConfigError("no vLLM build to test: install vllm, or set REPRO_VLLM / REPRO_VLLM_CONTROL")
        persons_choices(os.environ)  # a bad REPRO_WEIGHTS or REPRO_INJECT_SOURCE stops the run before any case starts
        which = [self.only] if self.only is not None else self.builds
        options = (self.backends, self.self_control, self.compile, self.methods, self.self_control_forms)
        cases = plan(which, self.modes, self.repeat, self.timeout_s, *options, self.control_kernels)
        cases, self.skipped_na = set_apart_not_applicable(cases)  # a method the build lacks: no process, no reference
        self.refuse_sm_counts()
        refs = list(dict.fromkeys(reference_for(c) for c in cases))
        if self.deadline_s is not None:  # every process of every case (attempts and reruns too) stops by then
            end = time.time() + self.deadline_s
            cases, refs = [replace(c, deadline_at=end) for c in cases], [replace(r, deadline_at=end) for r in refs]
        self.cases, self.refs = cases, refs

    def refuse_sm_counts(self) -> None:
        """A mode asking for an SM count this GPU cannot give is a ConfigError before any case starts; no GPU: those
        cases skip with the reason."""
        asked = [m for m in self.modes if m.sm.kind in ("sm_margin", "mps")]
        if not asked:
            return
        try:
            total = device_sm_count()
        except Unavailable:
            return
        for m in asked:
            if why := sm_refusal(m.sm.kind, m.sm.sms, total):
                raise ConfigError(f"gate mode {m.name}: {why}")

    def launch(self) -> None:
        """Forkservers first: each imports torch and vLLM (~20 s) while the GPU probes after them (seconds) run beside
        them; then the GPU's identity, the devices (one kind) and the memory budget."""
        if self.launched.kind == FORK:  # the builds with a case to run (`only`: that one; a method it lacks: none)
            for b in dict.fromkeys(c.build for c in self.cases):  # its cases' environment, less LATE_VARS
                plain = GateCase(b, GateMode.parse("plain"))
                audit = Path(self.log_dir) / "forkserver.audit.json"
                self.launched.start(b, case_env(plain, self.builds, audit, None, lambda: 0))
        self.gpu = gpu_identity() if self.cache is not None else ""
        self.measured = self.cache.load_costs(self.gpu) if self.cache is not None else {}
        warm = (lambda c: self.cache.is_warm(c.build, c.compile)) if self.cache else (lambda c: False)  # noqa: E731
        placed = list(self.devices or [])
        self.kind = main_kind(placed) if placed else None
        chosen = [d for d in placed if kind_of(d) == self.kind]
        self.pool = DevicePool(chosen, per_device_jobs(self.jobs, chosen)) if placed else None
        self.workers = self.pool.per_device * len(self.pool.devices) if self.pool else max(1, self.jobs)
        free = self.memory == "free GPU"
        of_free = lambda: MemoryBudget.of_free_gpu(keep_of_total=placement.FREE_AT_START)  # noqa: E731
        self.budget = None if self.pool else of_free() if free else self.memory  # type: ignore[assignment]
        self.cold = placement.ColdSlots(min(self.workers, self.cold_jobs or self.workers), warm)
        self.processes = placement.ProcessSlots(self.workers if self.cold_jobs is not None else None)

    def collect(self) -> None:
        """The MPS cases on a thread of their own (mps_part); the references first, beside the cases on slots of their
        own (a fitted concurrency, no device pool, several at once); the cases `workers` at a time, longest first."""
        under_mps = [c for c in self.cases + self.refs if c.mode.sm.kind == "mps"]
        refs = [c for c in self.refs if c.mode.sm.kind != "mps"]
        attempts = self.self_control_attempts or SELF_CONTROL_ATTEMPTS
        cases = case_order([c for c in self.cases if c.mode.sm.kind != "mps"], self.measured, retried, attempts)
        # beside where the gate fitted its concurrency (cold_jobs set); an explicit --jobs N: references first
        beside = refs and self.pool is None and self.workers > 1 and self.cold_jobs is not None
        mps_thread = threading.Thread(target=self.mps_part, args=(under_mps, bool(refs or cases)), daemon=True)
        mps_thread.start()
        go = lambda c: self.record(c, self.run_one(c, None))  # noqa: E731
        threads, ref_slots = ThreadPoolExecutor(self.workers), ThreadPoolExecutor(REF_SLOTS)
        futures = [ref_slots.submit(go, c) for c in refs] if beside else []
        futures += [threads.submit(go, c) for c in (cases if beside else refs + cases)]
        try:
            results_in_order(futures)  # a reference's error is the run's, as a case's is
            mps_thread.join()
        except BaseException:  # Ctrl-C, SIGTERM, a case's error: what is in flight stops now (gate.stopping)
            self.progress = None  # the cases killed now are no verdicts to print
            stop_in_flight(futures, [threads, ref_slots], self.launched.close, mps_thread.is_alive)
            raise
        threads.shutdown()
        ref_slots.shutdown()
        if self.mps_failed:  # the run must not be judged without its MPS cases
            raise self.mps_failed[0]

    def run_one(self, c: GateCase, mps: MpsDaemon | None) -> CaseResult:
        """Run one case's process (or load its kept reference): the process's own verdict, before any reference
        check; what else it left is kept for record()."""
        t = time.time()
        cache = self.cache
        kept = cache.load_reference(c.build, ref_key(c), self.gpu) if cache is not None and c.reference else None
        if kept is not None:
            self.ran_last[c.case_id] = _Ran(c, t, out=kept["result"])
            keep_in_logs(self.log_dir, c, kept)
            return kept_reference(c, kept)
        if (found := self.broken.get(platform_key(c))) is not None:  # it computes wrong here: no process of it runs
            self.ran_last[c.case_id] = _Ran(c, t, out={})
            why = f"not run: {found[0]}'s process found {found[1]}"
            return skipped(c, why).revised(PLATFORM_CHECK, why, verdict=ERROR, flags=[PLATFORM_FAILED])
        pool = self.pool
        dev = (pool.devices[0] if mps is not None else pool.take(self.kind)) if pool else None
        try:
            procs = 2 if attributed_beside(c) else 1  # its launch-blocking rerun beside it
            need = int(case_gib(c) * GIB) * procs
            held = self.budget.hold(need) if self.budget is not None else contextlib.nullcontext()
            with self.processes.hold(procs), self.cold.hold(c, procs), held:  # in this order; placement's slots
                t = time.time()  # its cost from here: a case's wait for a slot is no cost of its own
                # its reference's result and RESULT record once it finished (else None): a clean attempt judged early
                ref = lambda: self.done.get(reference_for(c).case_id)  # noqa: E731
                kw = dict(device=dev, launcher=self.launched, attempts=self.self_control_attempts, reference=ref)
                kw["caught_beside"] = partial(form_caught, c, self.run.cases, self.lock)  # none further once caught
                res, attribution, ran, tried = run_control(c, self.builds, self.log_dir, mps, cache, **kw)
        finally:
            if dev is not None and mps is None:
                pool.give(dev)
        self.ran_last[c.case_id] = _Ran(ran, t, attribution, tried)
        if platform_failed(res) and c.mode.sm.kind == "mps":
            self.broken.setdefault(platform_key(c), (c.case_id, res.reason))
        return res

    def record(self, c: GateCase, res: CaseResult) -> None:
        """Keep a case's final result (of its last process): a reference validated, and kept in the cache if good."""
        ran = self.ran_last[c.case_id]
        out = ran.out
        if out is None:
            self.took[c.case_id] = time.time() - ran.started  # its processes ran (not a kept reference, not a skip)
            out = result_line(self.log_dir, ran.logs)
            if c.reference:
                res = validate(c, res, out)
            if self.cache is not None and c.reference and res.verdict == CLEAN and out and out.get("tokens"):
                records = path_for(case_logs(self.log_dir, ran.logs.case_id)[0])
                text = records.read_text(errors="replace") if records.exists() else ""
                self.cache.store_reference(c.build, ref_key(c), self.gpu, out, res.to_dict(), text)
        with self.lock:
            self.keep(c, res, out, ran)
        if progress := self.progress:  # read once: a stop sets it None meanwhile
            progress(c, res)

    def keep(self, c: GateCase, res: CaseResult, out: dict | None, ran: _Ran) -> None:
        """A recorded case into the run (record, under the lock): its result, attribution, attempts, its build's span."""
        run = self.run
        self.outputs[c.case_id] = out
        if c.reference:
            self.done[c.case_id] = (res, out)
        (run.references if c.reference else run.cases).append((c, res))
        if ran.attribution:
            run.attributions.append(ran.attribution)
        run.attempts.extend(ran.attempts[1:])  # a further attempt's result whole; each attempt's exit beside
        if not c.reference:
            run.attempted[c.case_id] = [Attempt.of(a, r) for a, r in ran.attempts]
        span = self.starts.setdefault(c.build.label, [ran.started, ran.started])
        span[0], span[1] = min(span[0], ran.started), max(span[1], time.time())

    def set_aside(self, c: GateCase, attempt: str) -> None:
        """Before an MPS case runs again: its logs kept under the attempt's name, the attempt before forgotten."""
        set_aside_logs(Path(self.log_dir), c.case_id, attempt)
        self.ran_last.pop(c.case_id, None)  # the attempt before is not the result's: a rerun that never ran is a skip
        with self.lock:
            self.run.mps_reruns.append({"case": c.case_id, "attempt before": attempt})

    def mps_part(self, under_mps: list[GateCase], beside: bool) -> None:
        """The MPS cases under daemons owned by the run (repro.run.mps_cases, the matrix's shared policy): a control
        (expected to fault) alone under the daemon; the cases expected clean (builds under test, every build's
        references) as concurrent clients, a verdict a neighbour's fault could have caused rerun alone. `beside`:
        other cases run at the same time."""
        if not under_mps:
            return
        try:
            for c, res in run_mps_cases(
                under_mps,
                self.run_one,
                SHARED,
                # beside the other cases, or on a device pool (a MIG slice takes one case at a time): fewer clients
                jobs=1 if self.pool else max(1, self.workers // 2) if beside else self.workers,
                may_share=lambda c: c.reference or not c.is_control,
                daemon_factory=lambda: MpsDaemon(),
                before_rerun=self.set_aside,
                final=platform_failed,  # a failed platform check: no neighbour causes it, no rerun changes it
                alone_first=False,  # the clean-expected batches (quick) before controls that take minutes each
            ):
                if c.case_id not in self.ran_last:  # no daemon for it: skipped, the reason given
                    res = skipped(c, res.reason)
                    self.ran_last[c.case_id] = _Ran(c, time.time(), out={})
                self.record(c, res)
        except BaseException as e:  # the run must not be judged without its MPS cases: raised after the join
            self.mps_failed.append(e)

    def judge(self) -> None:
        """Each case against its reference's finished record (steps.finish: comparison, acceptance, coverage)."""
        run, outputs, done = self.run, self.outputs, self.done
        run.cases = [(c, finish(c, r, outputs.get(c.case_id), *done[reference_for(c).case_id])) for c, r in run.cases]
        # a self control's further attempts judged as its first was (a clean decode with a wrong draft is not clean)
        run.attempts = [
            (a, finish(a, r, result_line(self.log_dir, a), *done[reference_for(a).case_id])) for a, r in run.attempts
        ]

    def report(self) -> GateRun:
        """The run as its reports read it: the cases set apart beside the rest, in the plan's order, its walls."""
        run = self.run
        run.cases += self.skipped_na
        cases = self.cases + [c for c, _ in self.skipped_na]
        for c, r in self.skipped_na if self.progress else ():
            self.progress(c, r)
        order = {c.case_id: i for i, c in enumerate(cases)}
        run.cases.sort(key=lambda cr: order[cr[0].case_id])
        run.wall_s = round(time.time() - run.started_at, 1)
        run.build_wall_s = {k: round(v[1] - v[0], 1) for k, v in self.starts.items()}
        if self.cache is not None:
            self.cache.store_costs(self.gpu, self.took)
        return run


def run_gate(
    builds: list[VllmBuild],
    modes: tuple[GateMode, ...],
    log_dir: str | Path,
    repeat: int = 1,
    jobs: int = 3,
    timeout_s: float = 300.0,
    progress: Callable[[GateCase, CaseResult], None] | None = None,
    cache: GateCache | None = None,
    backends: tuple[str, ...] = (DEFAULT_BACKEND,),
    self_control: str = "under-test",
    devices: list[GateDevice] | None = None,
    only: VllmBuild | None = None,
    launcher: str | None = None,
    deadline_s: float | None = None,
    compile: str = DEFAULT_COMPILE,
    keep_forkserver: float | None = None,
    memory: MemoryBudget | None | str = "free GPU",
    methods: tuple[str, ...] = (DEFAULT_METHOD,),
    self_control_forms: tuple[str, ...] = INJECTIONS,
    self_control_attempts: int | None = None,
    cold_jobs: int | None = None,
    control_kernels: bool = False,
) -> GateRun:
    """Every case, references included, `jobs` at a time (GateScheduler's steps; `cold_jobs` of them on a build's cold
    caches, placement.ColdSlots); MPS cases under a daemon of the run (repro.run.mps_cases: controls alone, a
    neighbour's fault rerun alone). A cache (gate.cache) shares the build's vLLM caches and a kept reference; devices
    (gate.placement) place each case with its reference on one SM kind. `only`: that one build's cases (the pytest
    tier). The launcher (spawn or fork) says how case processes start (GateRun.launches). deadline_s (`--deadline`)
    ends every process; a case it stopped is a skip, or its stale-audit (gate.process.past_deadline). Each case holds
    its share of `memory` (placement.case_gib). self_control_forms, control_kernels: plan's `forms`,
    `control_kernels`; self_control_attempts: gate.process.run_control's `attempts`."""
    return GateScheduler(**locals())()  # its parameters are GateScheduler's fields, by name


def platform_key(case: GateCase) -> tuple[SmConfig, str | None]:
    """What a failed platform check holds for (GateScheduler.broken): the SM configuration and its torch."""
    return case.mode.sm, case.build.torch_prefix
