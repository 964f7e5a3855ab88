"""The vLLM gate's run and outcome: every gate case (repro.vllm_integration.gate.case: a vLLM build x detection mode)
as its own process (repro.vllm_integration.gate.worker) under a timeout, classified by the same verdict code as the
attention-layer cases (repro.judge.classify) and judged (repro.vllm_integration.gate.judge: annotation, the comparison
with the build's own reference run in the same SM configuration, coverage); a crash in the plain mode rerun once with
CUDA_LAUNCH_BLOCKING=1 to name the kernel; non-MPS cases in parallel; MPS cases under a daemon owned by the run, the cases expected clean as its concurrent
clients, each control alone, a rerun alone under a daemon of its own (repro.run.mps_cases).

The outcome goes through repro.judge.policy: AFFECTED when a build under test showed the bug, CANNOT VOUCH when a case's
checked feature did not fire, HARNESS BLIND when a control build (known bad) was not detected in a gating mode, else
PASS (a policy.GateOutcome; repro.exit_codes.gate gives its exit code)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

from repro.case.spec import CaseResult, SmConfig
from repro.contract.channel import path_for
from repro.contract.verdicts import CANNOT_VOUCH as NOT_VOUCHED
from repro.contract.verdicts import CLEAN, ERROR, FAULTS
from repro.errors import ConfigError, Unavailable
from repro.judge import policy
from repro.run.memory import GIB, MemoryBudget
from repro.run.mps_cases import SHARED, run_mps_cases
from repro.run.runner import case_logs, device_sm_count, set_aside_logs
from repro.run.smcontrol import MpsDaemon, sm_refusal
from repro.vllm_integration.gate.cache import GateCache, gpu_identity, keep_in_logs, kept_reference, ref_key
from repro.vllm_integration.gate.case import (
    FA3_ONLY,
    GateCase,
    GateMode,
    case_env,
    expected,
    persons_choices,
    reference_for,
    self_controls_for,
    subject_of,
)
from repro.vllm_integration.gate.judge import PLATFORM_CHECK, passes, platform_failed
from repro.vllm_integration.gate.launch import FORK, Launcher, launcher_kind
from repro.vllm_integration.gate.methods import DEFAULT_METHOD
from repro.vllm_integration.gate.placement import DevicePool, GateDevice, case_gib, kind_of, main_kind, per_device_jobs
from repro.vllm_integration.gate.process import (
    Attempt,
    attributed_beside,
    not_applicable_of,
    result_line,
    run_control,
    set_apart_not_applicable,
    skipped,
)
from repro.vllm_integration.gate.steps import finish, validate
from repro.vllm_integration.gate.worker import COMPILES, DEFAULT_COMPILE
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND
from repro.vllm_integration.plugin.inject import INJECTIONS
from repro.vllm_integration.releases.builds import VllmBuild

NO_CONTROL = "no positive control ran in a gating mode"


@dataclass
class GateRun:
    cases: list[tuple[GateCase, CaseResult]] = field(default_factory=list)
    references: list[tuple[GateCase, CaseResult]] = field(default_factory=list)
    attributions: list[tuple[GateCase, CaseResult]] = field(default_factory=list)  # launch-blocking reruns
    attempts: list[tuple[GateCase, CaseResult]] = field(default_factory=list)  # a self control's further attempts
    attempted: dict[str, list[Attempt]] = field(default_factory=dict)  # case id -> each attempt, the first included
    wall_s: float = 0.0
    started_at: float = 0.0  # when run_gate began (epoch s)
    setup_s: float | None = None  # a command's start-up before run_gate (CLI, builds, its GPU check); None: no command
    command_s: float | None = None  # the command's wall from its start to its report (None: no command)
    build_wall_s: dict[str, float] = field(default_factory=dict)
    launches: dict[str, dict] = field(default_factory=dict)  # per build: how its case processes started (Launcher)
    mps_reruns: list[dict] = field(default_factory=list)  # MPS cases run again (repro.run.mps_cases): which, after what
    source_checks: dict[str, str] = field(default_factory=dict)  # build prefix -> its source check (report), once
    judgment: policy.GateJudgment | None = None  # the answer, decided once (judge) and read by every report

    def controls(self) -> list[policy.Control]:
        """Every case as the policy sees it (control_of)."""
        return [control_of(c, r) for c, r in self.cases]

    def decision(self, need_control: bool = True) -> policy.GateDecision:
        """repro.judge.policy.decide over every case; without need_control (a bisect step answering for its build alone)
        the missing positive control is not a failure."""
        d = policy.decide(self.controls())
        if not need_control:
            d.failures = [f for f in d.failures if f.kind not in policy.NEEDS_A_CONTROL]
        return d

    def affected(self) -> list[tuple[GateCase, CaseResult]]:
        """Builds under test whose case did not come back clean (the bug, or no answer); a method the build does not
        have is neither (not applicable)."""
        return [(c, r) for c, r in self.cases if not c.is_control and not passes(c, r) and not_applicable_of(r) is None]

    def not_vouched(self) -> list[tuple[GateCase, CaseResult]]:
        """Cases (under test or control) whose checked feature did not fire."""
        return [(c, r) for c, r in self.cases if r.verdict == NOT_VOUCHED]

    def blind(self, need_control: bool = True) -> list[str]:
        """Why the controls cannot vouch for the run: the policy's failures that are not about a build under test."""
        under = {c.case_id for c, _ in self.cases if not c.is_control}
        out = []
        for f in self.decision(need_control).failures:
            if f.case_id in under:
                continue
            if f.kind in policy.NEEDS_A_CONTROL:
                f = (
                    f"{NO_CONTROL} (a build's self control: --self-control under-test; a known-bad build: "
                    f"--control 0.25.1=<prefix>): {f}"
                )
            out.append(f)
        return out

    def outcome(self, need_control: bool = True) -> policy.GateOutcome:
        """AFFECTED (a build under test showed the bug), CANNOT VOUCH (a case's checked feature did not fire, or a
        build under test errored or skipped), HARNESS BLIND (repro.judge.policy.decide failed on the controls: a control
        missed, or a gating mode has no evidence from its own control, or none ran while one is needed) or PASS;
        repro.exit_codes.gate gives its exit code."""
        affected = self.affected()
        if any(r.verdict in FAULTS for _, r in affected):
            return policy.GateOutcome.AFFECTED
        if affected or self.not_vouched():
            return policy.GateOutcome.CANNOT_VOUCH
        return policy.GateOutcome.BLIND if self.blind(need_control) else policy.GateOutcome.PASS

    def judge(self, need_control: bool = True) -> policy.GateJudgment:
        """Decide the run's answer once, for the question asked (need_control), and store it: reports read it."""
        d = self.decision(need_control)
        self.judgment = policy.GateJudgment(
            need_control, self.outcome(need_control), tuple(self.blind(need_control)), d
        )
        return self.judgment

    def judged(self) -> policy.GateJudgment:
        """The stored answer (judge); a run no command judged answers the gate's own question (a control needed)."""
        return self.judgment or self.judge()


class _Ran(NamedTuple):
    """What a case's last process left beside its verdict, for run_gate's record()."""

    logs: GateCase  # the case whose logs hold its records (a self control's later attempt, or the case itself)
    started: float
    attribution: tuple[GateCase, CaseResult] | None = None  # its launch-blocking rerun
    attempts: Sequence[tuple[GateCase, CaseResult]] = ()  # every attempt (run_control), the first included
    out: dict | None = None  # its RESULT record where no process left one (a kept reference, a skip); None: read it


def control_of(case: GateCase, res: CaseResult) -> policy.Control:
    """A gate case as the policy sees it, in `repro gate` and in the pytest tier alike: mode = the gate mode's name,
    the kind of control, and what policy rules 5 and 6 judge it over (subject_of)."""
    expect, na = res.expected or expected(case), not_applicable_of(res)
    c = policy.Control(case.case_id, expect, res.verdict, case.mode.name, res.reason, na, kind=case.control_kind)
    return replace(c, subject=subject_of(case, expect))


def plan(
    builds: list[VllmBuild],
    modes: tuple[GateMode, ...],
    repeat: int,
    timeout_s: float,
    backends: tuple[str, ...] = (DEFAULT_BACKEND,),
    self_control: str = "under-test",
    compile: str = DEFAULT_COMPILE,
    methods: tuple[str, ...] = (DEFAULT_METHOD,),
    forms: tuple[str, ...] = INJECTIONS,
) -> list[GateCase]:
    """Every case: build x method x backend x mode x repetition, and each build's self controls (self_controls_for:
    one per injection form, `forms`) in every method and mode beside its cases. sm_margin and poison hook FA3's calls:
    with another backend they are refused. `compile`: COMPILES. A method the build lacks: methods.not_applicable."""
    if compile not in COMPILES:
        raise ConfigError(f"--compile {compile!r}: use one of {', '.join(COMPILES)}")
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    fa3_only = [m.name for m in modes if m.name.split(":")[0] in FA3_ONLY]
    if fa3_only and any(b != DEFAULT_BACKEND for b in backends):
        raise ConfigError(f"mode {fa3_only[0]} hooks FA3's calls: run it with --backends {DEFAULT_BACKEND} only")
    return [
        GateCase(b, m, rep=r, timeout_s=timeout_s, backend=be, inject=inj, compile=compile, method=meth)
        for b in builds
        for meth in methods
        for inj in ((None, *forms) if self_controls_for(b, self_control) else (None,))
        for be in backends
        for m in modes
        for r in range(repeat)
    ]


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
) -> GateRun:
    """Every case, references included, `jobs` at a time; MPS cases under a daemon of the run (repro.run.mps_cases:
    controls alone, a neighbour's fault rerun alone). A cache (gate.cache) shares the build's vLLM caches and a kept
    reference; devices (gate.placement) place each case with its reference on one SM kind. `only`: that one build's
    cases (the pytest tier). The launcher (spawn or fork) says how case processes start (GateRun.launches). deadline_s
    (`--deadline`) ends every process; a case it stopped is a skip, or its stale-audit (gate.process.past_deadline).
    Each case holds its share of `memory` (placement.case_gib). self_control_forms: plan's `forms`;
    self_control_attempts: gate.process.run_control's `attempts` (`--self-control-attempts`)."""
    if not builds:
        raise ConfigError("no vLLM build to test: install vllm, or set REPRO_VLLM / REPRO_VLLM_CONTROL")
    persons_choices(os.environ)  # a bad REPRO_WEIGHTS or REPRO_INJECT_SOURCE stops the run before any case starts
    which = [only] if only is not None else builds
    cases = plan(which, modes, repeat, timeout_s, backends, self_control, compile, methods, self_control_forms)
    cases, skipped_na = set_apart_not_applicable(cases)  # a method the build lacks: no process, no reference
    asked = [m for m in modes if m.sm.kind in ("sm_margin", "mps")]
    if asked:
        try:
            total = device_sm_count()
        except Unavailable:
            total = None  # no GPU: those cases skip with the reason
        for m in asked if total is not None else ():
            if why := sm_refusal(m.sm.kind, m.sm.sms, total):
                raise ConfigError(f"gate mode {m.name}: {why}")
    refs = list(dict.fromkeys(reference_for(c) for c in cases))
    if deadline_s is not None:  # every process of every case (attempts and reruns too) stops by then: gate.process
        end = time.time() + deadline_s
        cases, refs = [replace(c, deadline_at=end) for c in cases], [replace(r, deadline_at=end) for r in refs]
    run = GateRun(started_at=time.time())
    lock = threading.Lock()
    starts: dict[str, list[float]] = {}
    outputs: dict[str, dict | None] = {}
    t0 = run.started_at

    ran_last: dict[str, _Ran] = {}  # case id -> what its last process left beside its verdict
    # an MPS SM configuration (with the torch that computes in it) -> (case id, why): its process found the GPU
    # computing bf16 products wrong there (measured at 24 and 40 SMs); later cases in it are errors that say so, not
    # processes that would each find it again (20-60 s apiece); the full GPU and sm_margin are judged case by case
    broken: dict[tuple[SmConfig, str | None], tuple[str, str]] = {}
    done: dict[str, tuple[CaseResult, dict | None]] = {}  # finished reference's id -> its result, RESULT record

    def run_one(c: GateCase, mps: MpsDaemon | None) -> CaseResult:
        """Run one case's process (or load its kept reference): the process's own verdict, before any reference
        check; what else it left is kept for record()."""
        t = time.time()
        kept = cache.load_reference(c.build, ref_key(c), gpu) if cache is not None and c.reference else None
        if kept is not None:
            ran_last[c.case_id] = _Ran(c, t, out=kept["result"])
            keep_in_logs(log_dir, c, kept)
            return kept_reference(c, kept)
        if (found := broken.get(platform_key(c))) is not None:  # it computes wrong here: no process of it runs
            ran_last[c.case_id] = _Ran(c, t, out={})
            why = f"not run: {found[0]}'s process found {found[1]}"
            return skipped(c, why).revised(PLATFORM_CHECK, why, verdict=ERROR)
        dev = (pool.devices[0] if mps is not None else pool.take(kind)) if pool else None
        try:
            need = int(case_gib(c) * GIB) * (2 if attributed_beside(c) else 1)  # its launch-blocking rerun beside it
            with budget.hold(need) if budget is not None else contextlib.nullcontext():
                ref_id, kw = reference_for(c).case_id, dict(device=dev, launcher=launch, attempts=self_control_attempts)
                res, attribution, ran, tried = run_control(
                    c, builds, log_dir, mps, cache, reference=lambda: done.get(ref_id), **kw
                )
        finally:
            if dev is not None and mps is None:
                pool.give(dev)
        ran_last[c.case_id] = _Ran(ran, t, attribution, tried)
        if platform_failed(res) and c.mode.sm.kind == "mps":
            broken.setdefault(platform_key(c), (c.case_id, res.reason))
        return res

    def record(c: GateCase, res: CaseResult) -> None:
        """Keep a case's final result (of its last process): a reference validated, and kept in the cache if good."""
        ran = ran_last[c.case_id]
        out = ran.out
        if out is None:
            out = result_line(log_dir, ran.logs)
            if c.reference:
                res = validate(c, res, out)
            if cache is not None and c.reference and res.verdict == CLEAN and out and out.get("tokens"):
                records = path_for(case_logs(log_dir, ran.logs.case_id)[0])
                text = records.read_text(errors="replace") if records.exists() else ""
                cache.store_reference(c.build, ref_key(c), gpu, out, res.to_dict(), text)
        with lock:
            outputs[c.case_id] = out
            if c.reference:
                done[c.case_id] = (res, out)
            (run.references if c.reference else run.cases).append((c, res))
            if ran.attribution:
                run.attributions.append(ran.attribution)
            run.attempts.extend(ran.attempts[1:])  # a further attempt's result whole; each attempt's exit beside
            if not c.reference:
                run.attempted[c.case_id] = [Attempt.of(a, r) for a, r in ran.attempts]
            span = starts.setdefault(c.build.label, [ran.started, ran.started])
            span[0], span[1] = min(span[0], ran.started), max(span[1], time.time())
        if progress:
            progress(c, res)

    everything = cases + refs  # speculative cases first: one of them writes the build's vLLM cache the rest then use
    under_mps = [c for c in everything if c.mode.sm.kind == "mps"]
    parallel = [c for c in everything if c.mode.sm.kind != "mps"]

    def set_aside(c: GateCase, attempt: str) -> None:
        set_aside_logs(Path(log_dir), c.case_id, attempt)
        ran_last.pop(c.case_id, None)  # the attempt before is not the result's: a rerun that never ran is a skip
        with lock:
            run.mps_reruns.append({"case": c.case_id, "attempt before": attempt})

    def mps_part() -> None:
        """The MPS cases under daemons owned by the run (repro.run.mps_cases, the matrix's shared policy): a control
        (expected to fault) alone under the daemon; the cases expected clean (builds under test, every build's
        references) as concurrent clients, a verdict a neighbour's fault could have caused rerun alone."""
        if not under_mps:
            return
        try:
            for c, res in run_mps_cases(
                under_mps,
                run_one,
                SHARED,
                # beside the other cases, or on a device pool (a MIG slice takes one case at a time): fewer clients
                jobs=1 if pool else max(1, workers // 2) if parallel else workers,
                may_share=lambda c: c.reference or not c.is_control,
                daemon_factory=lambda: MpsDaemon(),
                before_rerun=set_aside,
                final=platform_failed,  # a failed platform check: no neighbour causes it, no rerun changes it
                alone_first=False,  # the clean-expected batches (quick) before controls that take minutes each
            ):
                if c.case_id not in ran_last:  # no daemon for it: skipped, the reason given
                    res = skipped(c, res.reason)
                    ran_last[c.case_id] = _Ran(c, time.time(), out={})
                record(c, res)
        except BaseException as e:  # the run must not be judged without its MPS cases: raised after the join
            mps_failed.append(e)

    mps_failed: list[BaseException] = []
    launch = Launcher(launcher_kind(launcher), log_dir, keep_s=keep_forkserver)  # keep: forkservers outlive the run
    try:  # whatever stops the run (a failed probe, Ctrl-C, an error) stops the forkservers started here with it
        # forkservers first: each imports torch and vLLM (~20 s) while the GPU probes below (seconds) run beside them
        if launch.kind == FORK:  # the builds with a case to run (`only`: that one; a method it lacks: none), each once
            for b in dict.fromkeys(c.build for c in cases):  # its cases' environment, less gate.forkserver's LATE_VARS
                plain = GateCase(b, GateMode.parse("plain"))
                launch.start(b, case_env(plain, builds, Path(log_dir) / "forkserver.audit.json", None, lambda: 0))
        gpu = gpu_identity() if cache is not None else ""
        placed = list(devices or [])
        kind = main_kind(placed) if placed else None
        chosen = [d for d in placed if kind_of(d) == kind]
        pool = DevicePool(chosen, per_device_jobs(jobs, chosen)) if placed else None
        workers = pool.per_device * len(pool.devices) if pool else max(1, jobs)
        budget = None if pool else MemoryBudget.of_free_gpu() if memory == "free GPU" else memory
        mps_thread = threading.Thread(target=mps_part, daemon=True)
        mps_thread.start()
        with ThreadPoolExecutor(max_workers=workers) as threads:
            list(threads.map(lambda c: record(c, run_one(c, None)), parallel))
        mps_thread.join()
        if mps_failed:
            raise mps_failed[0]
    finally:
        run.launches = launch.summary()
        launch.close()
    run.cases = [(c, finish(c, r, outputs.get(c.case_id), *done[reference_for(c).case_id])) for c, r in run.cases]
    # a self control's further attempts judged as its first was (a clean decode with a wrong draft is not clean)
    run.attempts = [
        (a, finish(a, r, result_line(log_dir, a), *done[reference_for(a).case_id])) for a, r in run.attempts
    ]
    run.cases += skipped_na
    cases += [c for c, _ in skipped_na]
    for c, r in skipped_na if progress else ():
        progress(c, r)
    order = {c.case_id: i for i, c in enumerate(cases)}
    run.cases.sort(key=lambda cr: order[cr[0].case_id])
    run.wall_s = round(time.time() - t0, 1)
    run.build_wall_s = {k: round(v[1] - v[0], 1) for k, v in starts.items()}
    return run


def platform_key(case: GateCase) -> tuple[SmConfig, str | None]:
    """What a failed platform check holds for (run_gate's memo): the SM configuration and the torch computing in it."""
    return case.mode.sm, case.build.torch_prefix
