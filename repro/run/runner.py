"""Case runner: every case in its own process, always under a timeout, optionally under compute-sanitizer.

The verdict comes from the process: the worker's result line, the sanitizer log, the exit status, the clock. What
starts the processes: make_executor / default_executor (the harness's forkserver, repro.run.executor; or the repro
server, the same forkserver kept between commands)."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

from repro import entrypoints
from repro.case.scenarios import SPEC
from repro.case.spec import STALLED, CaseResult, CaseSpec
from repro.contract.channel import ENV as CHANNEL_ENV
from repro.contract.channel import SUFFIX as CHANNEL_SUFFIX
from repro.contract.channel import Channel
from repro.contract.channel import path_for as channel_path
from repro.contract.verdicts import EVIDENCE
from repro.errors import ConfigError, Unavailable
from repro.judge.classify import classify
from repro.judge.memcheck_log import first_finding_complete
from repro.run.executor import EXECUTORS, ForkExecutor, MemcheckAhead
from repro.run.pinning import PINNED_VAR
from repro.run.process import ProcessRun, Stall, case_env, kill_group
from repro.run.sanitizer import find_sanitizer, sanitizer_command, sanitizer_env
from repro.run.server import server_executor
from repro.run.smcontrol import MpsDaemon, device_sm_count

# A memcheck case is stopped this long after memcheck finished writing its first error (a stale case may never end
# and its verdict rests on that first error); the grace only lets the error count grow.
EARLY_STOP_GRACE_S = 0.5
_watched: set[int] = set()  # the case processes watch() waits on now (their session leaders' pids), any thread's
_watched_lock = threading.Lock()


def memcheck_launch_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment memcheck case processes start with before they know their case (repro.run.executor.WarmPool):
    worker_env's for a case on the whole GPU."""
    return sanitizer_env(case_env(base))


def worker_env(spec: CaseSpec, mps: MpsDaemon | None, base: dict[str, str] | None = None) -> dict[str, str]:
    env = case_env(base)
    if spec.sm.kind == "mig":
        pinned = env.get(PINNED_VAR, "")
        uuid = spec.sm.mig_uuid or (pinned if pinned.startswith("MIG-") else None)
        if not uuid:
            raise Unavailable("no MIG slice given (mig:<uuid>) and none pinned to this worker")
        env["CUDA_VISIBLE_DEVICES"] = uuid
    if spec.sm.kind == "mps":
        if mps is None:
            raise Unavailable("MPS case without an MPS daemon")
        env.update(mps.client_env(spec.sm.sms or 0, device_sm_count()))
    if spec.sanitizer:
        env = sanitizer_env(env)
    return env


def run_case(spec: CaseSpec, log_dir: str | Path, mps: MpsDaemon | None = None, executor=None) -> CaseResult:
    """Run one case in a fresh process under its timeout and classify it. Never raises for a faulting case."""
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        env = worker_env(spec, mps)
    except Unavailable as e:
        return CaseResult.skipped(spec, str(e))
    worker, main = entrypoints.ATTENTION_WORKER, entrypoints.ATTENTION_WORKER_MAIN
    if spec.scenario == SPEC:  # the spec-decode layer's worker, above the attention layer's (its main around it)
        worker, main = entrypoints.SPEC_WORKER, entrypoints.SPEC_WORKER_MAIN
    cmd = entrypoints.command(worker, spec.to_json())
    return run_process(spec, cmd, env, log_dir, spec.sanitizer, executor, (main, [spec.to_json()]))[0]


LOG_SUFFIXES = (".out.log", ".memcheck.log")  # a case process's output, and memcheck's log when it ran under it


def case_logs(log_dir: Path, case_id: str) -> tuple[Path, Path]:
    """Where a case process's output and its memcheck log go."""
    out, memcheck = (Path(log_dir) / f"{case_id}{suffix}" for suffix in LOG_SUFFIXES)
    return out, memcheck


def set_aside_logs(log_dir: Path, case_id: str, attempt: str) -> None:
    """Keep an attempt's logs as <case>.<attempt>.out.log / .memcheck.log / .channel.jsonl before the case runs
    again."""
    out, memcheck = case_logs(log_dir, case_id)
    for f, suffix in ((out, ".out.log"), (memcheck, ".memcheck.log"), (channel_path(out), CHANNEL_SUFFIX)):
        if f.exists():
            f.replace(Path(log_dir) / f"{case_id}.{attempt}{suffix}")


def run_process(
    spec, cmd: list[str], env: dict[str, str], log_dir: Path, sanitizer: bool, executor=None, target=None
) -> tuple[CaseResult, str]:
    """One case process (under memcheck when asked), supervised and classified: (result, the process's output).
    `spec` needs case_id, timeout_s and to_json() (CaseSpec, the vLLM gate's GateCase). With an executor
    (repro.run.executor) and a target (`module:function`, argv), the case is forked from it instead of started as cmd
    (started as cmd when the executor says it cannot fork: run() answers None); memcheck cases run under
    compute-sanitizer, in a process the executor started ahead (its WarmPool) where the environment fits, else as
    cmd."""
    out_path, memcheck_log = case_logs(log_dir, spec.case_id)
    records = channel_path(out_path)  # the case's structured channel (repro.contract.channel), beside its log
    records.unlink(missing_ok=True)
    memcheck_log.unlink(missing_ok=True)  # a memcheck log of an earlier run into this folder is not this run's
    env = {**env, CHANNEL_ENV: str(records)}
    rule = getattr(spec, "stall", None)  # a StallRule (the vLLM gate's cases), else only the timeout
    stall = Stall(out_path, rule) if rule is not None and not sanitizer else None
    if executor is not None and target is not None and not sanitizer:
        watched = {"stall": stall} if stall is not None else {}  # only the gate's launcher takes a stall watch
        run = executor.run(target[0], target[1], env, out_path, spec.timeout_s, **watched)
        if run is not None:
            out = out_path.read_text(errors="replace") if out_path.exists() else ""
            res = classify(spec, out, run.returncode, run.timed_out, None, run.wall_s, Channel.read(records))
            return with_process_phases(stalled(res, run, stall), run), out
    san_log = None
    warm = None
    if sanitizer:
        exe = find_sanitizer()
        if not exe:
            return CaseResult.skipped(spec, "compute-sanitizer not found (install the CUDA toolkit)"), ""
        san_log = memcheck_log
        pool = getattr(executor, "warm", None)
        warm = pool.take(env) if pool is not None and target is not None else None
        padding = getattr(spec, "sanitizer_padding", None)  # the vLLM gate's memcheck:own cases
        cmd = sanitizer_command(exe, str(san_log), kernel_filter="flash", padding=padding) + cmd
    if warm is not None:
        t0 = warm.start_case(target[0], target[1], env, out_path)
        run = watch(warm.proc, t0, spec.timeout_s, warm.memcheck_log)
        if warm.memcheck_log.exists():
            warm.memcheck_log.replace(san_log)
    else:
        run = supervise(cmd, env, out_path, spec.timeout_s, san_log, stall)
    out = out_path.read_text(errors="replace")
    log_text = None  # memcheck's log; "" when it ran and left none (classify: nothing vouched)
    if san_log is not None:
        log_text = san_log.read_text(errors="replace") if san_log.exists() else ""
    res = classify(spec, out, run.returncode, run.timed_out, log_text, run.wall_s, Channel.read(records))
    if run.stopped_early:
        res.reason += f" (stopped {EARLY_STOP_GRACE_S:g} s after memcheck's first complete finding)"
    return with_process_phases(stalled(res, run, stall), run), out


def stalled(res: CaseResult, run: ProcessRun, stall: Stall | None) -> CaseResult:
    """A hang its Stall watch stopped: the reason says so (the timeout it did not wait for is not the hang's)."""
    if run.stalled and stall is not None:
        res.reason = f"{stall.why()}, {run.wall_s:.0f} s in; {res.reason}"
        res.evidence = f"{EVIDENCE[res.verdict]}: stalled {run.wall_s:.0f} s in (the stall rule, not the timeout)"
        res.flags.append(STALLED)
    return res


def with_process_phases(res: CaseResult, run: ProcessRun) -> CaseResult:
    """Complete the worker's phases (import, CUDA init, work) with what only the parent sees: process start (until
    the worker's main ran) and teardown (after its work, until the parent saw it exit). A process that ended without
    a result (a fault) reported only its start-up: everything after CUDA init is `rest_s` (work and the teardown)."""
    res.started_at = run.started_at or None
    p = res.phases
    if p and "main_at" in p and run.started_at:
        end = run.started_at + run.wall_s
        ready = p["main_at"] + p["import_s"] + p["cuda_init_s"]
        phases = {
            "start_s": round(p["main_at"] - run.started_at, 3),
            "import_s": p["import_s"],
            "cuda_init_s": p["cuda_init_s"],
        }
        if "work_s" in p:
            phases["work_s"] = p["work_s"]
            phases["teardown_s"] = round(end - ready - p["work_s"], 3)
        else:
            phases["rest_s"] = round(end - ready, 3)
        res.phases = phases
    return res


def supervise(
    cmd: list[str],
    env: dict[str, str],
    out_path: Path,
    timeout_s: float,
    san_log: Path | None = None,
    stall: Stall | None = None,
) -> ProcessRun:
    """Run one case process in a session of its own, stdout and stderr into out_path, and watch it."""
    t0 = time.time()
    with open(out_path, "w") as out_file:
        proc = subprocess.Popen(
            cmd, stdout=out_file, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True
        )
    return watch(proc, t0, timeout_s, san_log, stall)


def watch(
    proc: subprocess.Popen, t0: float, timeout_s: float, san_log: Path | None = None, stall: Stall | None = None
) -> ProcessRun:
    """Wait for a case process (the leader of its own session); kill the whole session at the timeout, when its
    Stall watch says it hangs, or EARLY_STOP_GRACE_S after memcheck finished writing its first error to san_log (a
    stale case may never finish)."""
    timed_out, stopped_early, hung = False, False, False
    first_finding: float | None = None
    with _watched_lock:
        _watched.add(proc.pid)
    try:
        while True:
            try:
                proc.wait(timeout=0.1)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.time()
            if san_log is not None and first_finding is None and _has_finding(san_log):
                first_finding = now
            if first_finding is not None and now - first_finding > EARLY_STOP_GRACE_S:
                stopped_early = True
            elif now - t0 > timeout_s:
                timed_out = True
            elif stall is not None and stall.check(now):
                timed_out = hung = True
            else:
                continue
            kill_group(proc.pid)
            proc.wait()
            break
    except BaseException:  # Ctrl-C or an error in the parent: leave no orphan behind
        kill_group(proc.pid)
        proc.wait()
        raise
    finally:
        with _watched_lock:
            _watched.discard(proc.pid)
    return ProcessRun(proc.returncode, timed_out, stopped_early, time.time() - t0, t0, stalled=hung)


def stop_watched() -> int:
    """Kill the session of every case process watch() waits on now, in any thread (the main thread's Ctrl-C reaches
    no other thread): each watch returns as for a crash. How many there were."""
    with _watched_lock:
        pids = list(_watched)
    for pid in pids:
        kill_group(pid)
    return len(pids)


def _has_finding(path: Path) -> bool:
    try:
        with open(path, errors="replace") as f:
            return first_finding_complete(f.read(1 << 18))
    except OSError:
        return False


def make_executor(name: str, jobs: int = 4) -> MemcheckAhead | None:
    """None: a fresh interpreter per case; forkserver: the harness's forkserver (ForkExecutor); server: a running repro
    server (repro.run.server); each with `jobs` memcheck processes started ahead."""
    if name == "process":
        return None
    if name == "forkserver":
        return ForkExecutor(case_env(), spares=jobs)
    if name == "server":
        served, why = server_executor(jobs)
        if served is None:
            raise ConfigError(f"--executor server: {why}")
        return served
    raise ConfigError(f"unknown executor {name!r}; choose from {', '.join(EXECUTORS)}")


def default_executor(jobs: int = 4) -> MemcheckAhead:
    """The repro server when one runs this code (its cases start without importing anything), else a forkserver."""
    return server_executor(jobs)[0] or ForkExecutor(case_env(), spares=jobs)
