"""One gate case's process: run_case (its own process under a timeout, classified and annotated), the
CUDA_LAUNCH_BLOCKING=1 rerun that names a plain-mode crash's kernel (run_attributed), and a self control's further
attempts when it decoded without a fault (run_control). repro.vllm_integration.gate.run schedules them."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from repro import entrypoints
from repro.case.spec import STALLED, CaseResult
from repro.contract.channel import ATTEMPTS, Channel, has
from repro.contract.tags import COUNTERS_TAG, DEVICE_TAG, RESULT_TAG
from repro.contract.verdicts import CLEAN, CRASH, ERROR, HANG, KERNEL_EVIDENCE, SKIP, STALE_AUDIT, WRONG
from repro.errors import MissingKey, Unavailable
from repro.run.runner import case_logs, device_sm_count, run_process
from repro.run.smcontrol import MpsDaemon
from repro.vllm_integration.gate import bench as gate_bench
from repro.vllm_integration.gate.cache import PRIVATE, TRITON_CACHE, TRITON_ENV, WRITER, GateCache
from repro.vllm_integration.gate.case import GateCase, case_env, expected, subject_of
from repro.vllm_integration.gate.launch import Launcher
from repro.vllm_integration.gate.methods import form_not_applicable, not_applicable
from repro.vllm_integration.gate.modes import PLAIN
from repro.vllm_integration.gate.placement import GateDevice
from repro.vllm_integration.gate.steps import annotate, finish
from repro.vllm_integration.releases.builds import VllmBuild


def run_case(
    case: GateCase,
    builds: list[VllmBuild],
    log_dir: str | Path,
    mps: MpsDaemon | None = None,
    total_sms: Callable[[], int] = device_sm_count,
    cache: GateCache | None = None,
    device: GateDevice | None = None,
    launcher: Launcher | None = None,
) -> CaseResult:
    """One gate case in its own process; never raises for a faulting case. With a cache (the new path), the case's
    VLLM_CACHE_ROOT is its build's folder (used in place once complete, or written by this case as the build's one
    writer) or an empty folder of its own (GateCache.case_cache); without (the old path) every case starts cold.
    With a launcher (repro.vllm_integration.gate.launch) the process may be forked from its build's forkserver;
    without, it is spawned. Its phases say which (`launcher`) and, when not the one asked for, why."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    if case.deadline_at is not None:  # `--deadline`: no process starts after it, none runs past it
        left = case.deadline_at - time.time()
        if left <= 0:
            return skipped(case, f"not started: the run's --deadline had passed ({-left:.0f} s before)")
        if left < case.timeout_s:
            return past_deadline(case, run_case(replace(case, timeout_s=left, deadline_at=None), builds, log_dir, mps,
                                                total_sms, cache, device, launcher))  # fmt: skip
    audit_file = log_dir / f"{case.case_id}.audit.json"
    audit_file.unlink(missing_ok=True)  # an earlier run into this folder must not lend this case its mismatches
    # the models' folder is part of vLLM's compile-cache key: one folder per build on the new path
    model_dir = cache.build_dir(case.build) / "models" if cache is not None else log_dir / f"{case.case_id}.models"
    try:
        env = case_env(
            case, builds, audit_file, mps, total_sms, device=device.dev if device else None, models=model_dir
        )
    except Unavailable as e:
        return skipped(case, str(e))
    private = Path(env["VLLM_CACHE_ROOT"])
    vllm_cache = PRIVATE
    if cache is not None:
        root, vllm_cache = cache.case_cache(case.build, private, may_write=not case.reference, compile=case.compile)
        env["VLLM_CACHE_ROOT"] = str(root)
    # Triton's kernels: the build's folder on the cache path, the case's own cold one without (never ~/.triton)
    env[TRITON_ENV] = str(cache.triton_dir(case.build) if cache is not None else private / TRITON_CACHE)
    cmd = entrypoints.command(entrypoints.GATE_WORKER)  # what it runs: its request (repro.contract.request) in env
    sanitized = bool(case.mode.sanitizer) and not case.reference
    if launcher is not None:
        res, out, launched = launcher.launch(case, cmd, env, log_dir, sanitized, run_process)
    else:
        (res, out), launched = run_process(case, cmd, env, log_dir, sanitized), {"launcher": "spawn"}
    ch = Channel.of_case(case_logs(log_dir, case.case_id)[0], out)
    if vllm_cache == WRITER:  # captures ran: torch.compile had finished and saved into the build's folder
        captured = bool(sum(((ch.last(COUNTERS_TAG) or {}).get("captures") or {}).values()))
        cache.release(case.build, captured, compile=case.compile)
    shutil.rmtree(private, ignore_errors=True)  # a case's own cold cache: not evidence
    if not case.reference:
        res.expected = expected(case)  # fixed before the case is judged
    if res.verdict == SKIP:
        res.vllm_version = case.build.version
        return res
    res.phases = {
        **gate_bench.phases(out, ch.last(RESULT_TAG), res.started_at, res.wall_s, ch.last(DEVICE_TAG)),
        "vllm_cache": vllm_cache,
        **launched,
    }
    return annotate(res, case, ch, audit_file if audit_file.exists() else None)


def attributable(case: GateCase) -> bool:
    """Is a crash of this case rerun with CUDA_LAUNCH_BLOCKING=1 to name its kernel (run_attributed)? Not where
    plan turned it off (`GateCase.name_kernel`: a self control unless asked)."""
    return case.mode == PLAIN and not case.rep and not case.reference and case.name_kernel


def attributed_beside(case: GateCase) -> bool:
    """Does this case's launch-blocking rerun start beside it (run_attributed: a plain-mode control, expected to
    crash), so that two of its processes run at once?"""
    return attributable(case) and case.is_control


def run_attributed(
    case: GateCase,
    builds: list[VllmBuild],
    log_dir: str | Path,
    mps: MpsDaemon | None = None,
    cache: GateCache | None = None,
    device: GateDevice | None = None,
    launcher: Launcher | None = None,
) -> tuple[CaseResult, tuple[GateCase, CaseResult] | None]:
    """run_case, and for a crash in the plain mode (first repetition) a rerun with CUDA_LAUNCH_BLOCKING=1 that names
    the faulting kernel: (result, (rerun case, rerun result) or None). A control is expected to crash: its rerun
    starts beside it, on the same device, and is dropped (whatever became of it; its logs stay) when the case did
    not crash; any other case's rerun starts after its crash."""
    rc = replace(case, launch_blocking=True)
    ahead = None
    if attributed_beside(case):
        ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="attribution")
        early = ahead.submit(run_case, rc, builds, log_dir, mps, cache=cache, device=device, launcher=launcher)
    try:
        res = run_case(case, builds, log_dir, mps, cache=cache, device=device, launcher=launcher)
    finally:
        if ahead is not None:
            ahead.shutdown(wait=True)
    if device is not None:
        res = replace(res, backend_identity={**(res.backend_identity or {}), "device": device.to_dict()})
    if res.verdict != CRASH or not attributable(case):
        return res, None
    if ahead is not None:
        rerun = early.result()
    else:
        rerun = run_case(rc, builds, log_dir, mps, cache=cache, device=device, launcher=launcher)
    kernel = rerun.kernel if rerun.verdict == CRASH else None
    if kernel:
        res = res.revised(
            "attribution rerun",
            f"{rc.case_id} crashed in the {kernel} kernel's launch check",
            kernel=kernel,
            evidence=f"fault in the {kernel} kernel (named by a CUDA_LAUNCH_BLOCKING=1 rerun)",
        )
    return res, (rc, rerun)


# A self control outside the audit mode that decoded without a fault runs again, up to this many attempts in all:
# whether the injected defect faults, like the real one's (repro.judge.policy rule 5), hangs on what memory the stale
# launch reads (results/h200-paths-29-partial: 0.26.0's self control in plain with the same injection, 98 metadata
# objects handed over in both, crashed on the cold and fork paths and decoded cleanly on the warm one). Any attempt's
# fault is the mode's evidence; the build under test never runs again.
SELF_CONTROL_ATTEMPTS = 3


def retried(case: GateCase) -> bool:
    """Does this case get further attempts when it decodes without a fault (a self control in a gating mode other
    than the audit, whose stale views are read from the engine on every attempt alike)?"""
    return case.inject is not None and case.mode.gating and not case.mode.audit and not case.reference


def form_caught(c: GateCase, cases: list[tuple[GateCase, CaseResult]], lock: Any) -> str | None:
    """Another form of c's self control among the run's cases (the same subject_of: what policy rule 6 judges its
    forms over) whose process showed kernel evidence with its injection written: c's further attempts would add
    nothing the policy reads (rule 6 lists a form's miss beside a caught one). None: none yet."""
    subject = subject_of(c, expected(c))
    if subject is None:
        return None
    with lock:
        for o, r in cases:
            wrote = (r.backend_identity or {}).get("injection")
            if o.inject not in (None, c.inject) and r.verdict in KERNEL_EVIDENCE and wrote:
                if subject_of(o, expected(o)) == subject:
                    return f"the self control's form {o.inject} in this mode showed {r.verdict} ({o.case_id})"
    return None


def run_control(
    case: GateCase,
    builds: list[VllmBuild],
    log_dir: str | Path,
    *where: Any,
    reference: Callable[[], tuple[CaseResult, dict | None] | None] = lambda: None,
    attempts: int | None = None,
    caught_beside: Callable[[], str | None] = lambda: None,
    **how: Any,
) -> tuple[CaseResult, tuple[GateCase, CaseResult] | None, GateCase, list[tuple[GateCase, CaseResult]]]:
    """run_attributed (with the same arguments after the case: builds, log_dir, mps, cache, device, launcher), then,
    for a `retried` case that came back clean, more attempts (each its own process and logs, case id ...-attemptN)
    until one shows a fault or hang, at most `attempts` in all (None: SELF_CONTROL_ATTEMPTS, read when called), or
    until a clean attempt's tokens or draft are already wrong against its reference: `reference()` gives the
    reference's result and RESULT record once it finished (else None), and the judging the run ends with
    (steps.finish: the comparison, then vouch, which discounts a wrong answer whose injection never wrote) is made
    early (0.21.0's self control: a silently wrong draft, which further attempts only repeated, 100 s each). Returns the result kept under the case's own id (the first attempt
    with evidence, revised to say which; else the first), its attribution rerun, the case whose logs hold it, and
    every attempt as it came back, the first included (results.json keeps each, its further attempts' results whole and
    every attempt's exit as an Attempt, so a replay makes the attempts the run made, each as its process ended).
    `caught_beside()`: why no further attempt is needed (another form of this self control in the same mode already
    showed kernel evidence: the policy lists this form's miss beside it, rule 6), else None; asked before each
    further attempt, and said in the result's reason."""

    def evident(ran: GateCase, res: CaseResult) -> bool:
        if res.verdict != CLEAN:  # a timeout that annotate made an error (before the captures) is no evidence: again
            return not (res.verdict == ERROR and was_hang(res))
        ref = reference()
        return ref is not None and finish(ran, res, result_line(log_dir, ran), *ref).verdict == WRONG

    attempts = SELF_CONTROL_ATTEMPTS if attempts is None else attempts
    res, attribution = run_attributed(case, builds, log_dir, *where, **how)
    ran, tried = case, [(case, res)]
    found = not retried(case) or evident(case, res)  # each attempt is judged once
    for k in range(1, attempts):
        if found:
            break
        if why := caught_beside():
            res = res.revised("self-control attempt", why, reason=f"{res.reason}; no further attempt: {why}")
            break
        again = replace(case, attempt=k)
        r, a = run_attributed(again, builds, log_dir, *where, **how)
        tried.append((again, r))
        if found := evident(again, r):
            why = f"attempt {k + 1} of {attempts} ({again.case_id}); the earlier decoded without a fault"
            res, attribution, ran = r.revised("self-control attempt", why, case_id=case.case_id), a, again
    return res, attribution, ran, tried


@dataclass(frozen=True)
class Attempt:
    """One attempt of a gate case, its own process, as results.json keeps it beside the case's result (its row's
    `attempts`): what a replay needs to remake that process's verdict as the run made it, the first attempt's too
    where a later one's result is kept under the case's id."""

    attempt: int  # 1: the case's first process; k: its further attempt k (case id ...-attemptk)
    case: str  # the case id its process ran and left its logs under
    returncode: int | None  # its exit status (None: no process ran, a skip)
    timed_out: bool  # stopped at its timeout or by its stall watch: classify made it a hang (was_hang)
    verdict: str  # as run_control judged it: its process ended, before its reference was known
    reason: str
    wall_s: float
    log: str  # its output's name in the run's logs folder (its channel records beside it)

    @classmethod
    def of(cls, case: GateCase, res: CaseResult) -> Attempt:
        log = case_logs(Path("."), case.case_id)[0].name
        return cls(
            case.attempt + 1, case.case_id, res.returncode, was_hang(res), res.verdict, res.reason, res.wall_s, log
        )

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Attempt:
        if missing := [f.name for f in fields(cls) if f.name not in d]:
            raise MissingKey(f"an attempt of {d.get('case')!r} in results.json lacks {missing} (not trusted)")
        return cls(**{f.name: d[f.name] for f in fields(cls)})


def recorded_attempts(row: dict) -> list[Attempt] | None:
    """The attempts a results.json row of the gate (report.rows) keeps: every process of a case row, none for another
    kind's row (its result is its one process's); None where the replays' upgrader marked the row as from before rows
    kept them (records.upgrade_gate_row: its result, a later attempt's where one was kept, is all there is). A row
    that lacks them unmarked (a live record) is a MissingKey."""
    if not has(row, "attempts", ATTEMPTS, f"results.json's row {row.get('case')!r}"):
        return None
    return [Attempt.from_dict(a) for a in row["attempts"] or ()]


def result_line(log_dir: str | Path, case: GateCase) -> dict | None:
    """The RESULT record a finished case process wrote (tokens, margins, version, timing), or None."""
    return Channel.of_case(case_logs(log_dir, case.case_id)[0]).last(RESULT_TAG)


def past_deadline(case: GateCase, res: CaseResult) -> CaseResult:
    """A case whose timeout the run's deadline cut: a HANG there is the deadline's kill, not a hang (a stall the
    watch stopped stays one). What the auditor had caught before the kill stays evidence (stale views in an audit
    mode); else the case is a skip that says so."""
    if not was_hang(res) or STALLED in res.flags:  # a hang, whatever annotate made of it (before capture, or plugin)
        return res
    why = f"stopped at the run's --deadline, {res.wall_s:.0f} s in (its own timeout: {case.timeout_s:g} s)"
    if case.mode.audit and res.stale_fields:
        return res.revised("deadline", why, verdict=STALE_AUDIT, reason=f"{why}; {res.reason}")
    return skipped(case, why)


def was_hang(res: CaseResult) -> bool:
    """Did classify make the case a hang (its process stopped at its timeout), before any later step revised it?"""
    return res.first_verdict == HANG


def skipped(case: GateCase, reason: str) -> CaseResult:
    res = CaseResult.skipped(case, reason)
    res.vllm_version = case.build.version
    if not case.reference:
        res.expected = expected(case)
    return res


NOT_APPLICABLE_STEP = "not applicable"  # a result's history step: its method is not one its build has


def not_applicable_result(case: GateCase, why: str) -> CaseResult:
    """A case of a method its build does not have, or captures no FULL draft graph for (gate.methods.not_applicable):
    a skip that says why in its typed field (CaseResult.not_applicable), never clean; the policy lists it as not
    applicable (outcome.control_of)."""
    what = f"not applicable: {why}"
    return skipped(case, what).revised(NOT_APPLICABLE_STEP, why, evidence=what, not_applicable=why)


def set_apart_not_applicable(cases: list[GateCase]) -> tuple[list[GateCase], list[tuple[GateCase, CaseResult]]]:
    """(the cases to run, the cases of a method their build does not have, or of a self-control form it cannot
    re-create, with their not-applicable results), read from each build's files once per method and once per form and
    backend (gate.methods.not_applicable, form_not_applicable)."""
    method_why: dict[tuple, str | None] = {}
    form_why: dict[tuple, str | None] = {}

    def of(c: GateCase) -> str | None:  # the method's answer, then the self-control form's: each read once
        m, f = (c.build, c.method), (c.build, c.inject, c.backend)
        if m not in method_why:
            method_why[m] = not_applicable(c.build.package_dir, c.method)
        if method_why[m]:
            return method_why[m]
        if f not in form_why:
            form_why[f] = form_not_applicable(c.build.package_dir, c.inject, c.backend)
        return form_why[f]

    run = [c for c in cases if not of(c)]
    return run, [(c, not_applicable_result(c, of(c))) for c in cases if of(c)]
