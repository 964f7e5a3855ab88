"""How a vLLM gate case process starts (`gate --launcher fork|spawn`, REPRO_GATE_LAUNCHER): spawned (`python -m
repro.vllm_integration.gate.worker`, a fresh interpreter that imports torch, vLLM and the plugin: ~20 s on the H200) or
forked from its build's forkserver (repro.vllm_integration.gate.fork), which imported them once, without CUDA.

- One forkserver per build, started with the environment the build's cases get less the variables that differ per
  case (LATE_VARS: the device, MPS, CUDA_LAUNCH_BLOCKING, the plugin's REPRO_* switches, the case's VLLM_CACHE_ROOT
  and channel file; CUDA_VISIBLE_DEVICES is kept as the run has it), all read after import: at CUDA's start, at the
  plugin's registration, at the engine's start.
- A case whose environment differs from its forkserver's in any other variable (one read at import: the Python path,
  PYTORCH_CUDA_ALLOC_CONF, LD_*, TORCH_*, ...), or in a per-case variable that Python code read while the forkserver
  imported (its READY record's read_late), is launched plainly, and its record says why; so is a memcheck case
  (compute-sanitizer runs a program of its own).
- A build whose forkserver refused (an import failed, CUDA started while importing, an import set a per-case
  variable: gate_fork.prepare), did not get ready in READY_TIMEOUT_S, or died, has its cases launched plainly from
  then on; a case its forkserver was running when it died is killed and launched again plainly. Each such change is
  a note of the build (Launcher.summary, shown in the gate's report), never silent.
- The gate keeps what it had: the case's timeout from its request, the whole process group killed at it, the exit
  status (negative: the signal), the log and the channel file of the case. Between the gate and a forkserver only
  typed records pass (gate_fork.encode / decode)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from repro.errors import ConfigError, ForkServerDied, ForkUnavailable, ProtocolError
from repro.run.channel import ENV as CHANNEL_ENV
from repro.run.process import ProcessRun, Stall, kill_group
from repro.vllm_integration.gate import fork as gate_fork
from repro.vllm_integration.plugin import SWITCHES as PLUGIN_SWITCHES
from repro.vllm_integration.plugin.inject import INJECT_SOURCE_ENV

FORK, SPAWN = "fork", "spawn"
LAUNCHERS = (FORK, SPAWN)
LAUNCHER_ENV = "REPRO_GATE_LAUNCHER"
# fork gives the spawned records on every stand-in behaviour (tests/test_vllm_gate_fork.py) but has not run real vLLM
# on a GPU yet: opt in with --launcher fork until a GPU run of `gate --compare-paths` shows no verdict difference
DEFAULT_LAUNCHER = SPAWN
PRELOAD_ENV = "REPRO_GATE_PRELOAD"  # more modules for the forkserver to import (MODULE[:ATTR],...), e.g. the runner's
TARGET_MAIN = f"{gate_fork.TARGET}:main"
READY_TIMEOUT_S = 300.0  # a forkserver importing longer than this is given up (its build launched plainly)
ANSWER_TIMEOUT_S = 60.0  # a RUN request without a STARTED or NOT_STARTED record by then: the forkserver is stuck
KILL_WAIT_S = 30.0  # after the kill at a timeout, how long to wait for the forkserver to report the exit
LATE_VARS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",  # read when CUDA starts (placement)
        "CUDA_MPS_PIPE_DIRECTORY",  # MPS client: read when CUDA starts
        "CUDA_MPS_LOG_DIRECTORY",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_LAUNCH_BLOCKING",  # the attribution rerun: read when the CUDA context is made
        "VLLM_CACHE_ROOT",  # vllm.envs reads it when asked (the model registry, torch.compile), not at import
        CHANNEL_ENV,  # read at each record
        *PLUGIN_SWITCHES,  # read by plugin.register when vLLM loads its general plugins
        INJECT_SOURCE_ENV,
    }
)


def launcher_kind(asked: str | None = None, environ: dict[str, str] | None = None) -> str:
    """`--launcher` when given, else REPRO_GATE_LAUNCHER, else DEFAULT_LAUNCHER."""
    kind = (asked or (os.environ if environ is None else environ).get(LAUNCHER_ENV) or DEFAULT_LAUNCHER).lower()
    if kind not in LAUNCHERS:
        raise ConfigError(f"launcher {kind!r}: use {' or '.join(LAUNCHERS)} (--launcher, {LAUNCHER_ENV})")
    return kind


KEPT_LATE = frozenset({"CUDA_VISIBLE_DEVICES"})  # the same for every case of a run without --devices: kept


def launch_env(env: dict[str, str]) -> dict[str, str]:
    """A forkserver's environment: a case's, less what differs per case (KEPT_LATE kept as the case has it)."""
    return {k: v for k, v in env.items() if k not in LATE_VARS or k in KEPT_LATE}


def differs(env: dict[str, str], launch: dict[str, str], read_at_import=()) -> list[str]:
    """The variables in which a case's environment differs from its forkserver's: any but LATE_VARS, and those of
    LATE_VARS that Python code read while the forkserver imported."""
    keys = ((set(env) | set(launch)) - LATE_VARS) | set(read_at_import)
    return sorted(k for k in keys if env.get(k) != launch.get(k))


class ForkServer:
    """One build's forkserver process and the gate's end of its pipes. Thread-safe: the gate's case threads share it."""

    def __init__(self, label: str, env: dict[str, str], log_path: Path, preload: tuple[str, ...]) -> None:
        self.label, self.launch_env, self.log_path = label, launch_env(env), Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.ready: dict | None = None
        self.ready_at: float | None = None
        self.closing = False
        self.failed: str | None = None
        self.import_log = b""  # what its imports printed: each case's log starts with it, as a fresh process's does
        self._cv = threading.Condition()
        self._events: dict[int, dict[str, dict]] = {}
        self._next = 0
        self._wlock = threading.Lock()
        self.t0 = time.time()
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        cmd = [sys.executable, "-m", "repro.vllm_integration.gate.fork", "--requests", str(req_r)]
        cmd += ["--replies", str(rep_w), "--preload", ",".join(preload), "--late", ",".join(sorted(LATE_VARS))]
        try:
            with open(self.log_path, "wb") as log:
                self.proc = subprocess.Popen(
                    cmd,
                    env=self.launch_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(req_r, rep_w),
                    start_new_session=True,
                )
        finally:
            os.close(req_r)
            os.close(rep_w)
        self._req = req_w
        self._rep = os.fdopen(rep_r, "rb")
        threading.Thread(target=self._read, name=f"forkserver-{label}", daemon=True).start()

    def _read(self) -> None:
        why = None
        try:
            for line in self._rep:
                rec = gate_fork.decode(line)
                with self._cv:
                    if rec["kind"] == gate_fork.READY:
                        self.import_log = self.log_path.read_bytes() if self.log_path.exists() else b""
                        self.ready, self.ready_at = rec, time.time()
                    elif rec["kind"] == gate_fork.REFUSED:
                        why = f"refused: {rec.get('reason')}"
                    elif "id" in rec:
                        self._events.setdefault(rec["id"], {})[rec["kind"]] = rec
                    self._cv.notify_all()
        except (ProtocolError, OSError, ValueError) as e:
            why = f"its records broke off: {e}"
            kill_group(self.proc.pid)
        code = self.proc.wait()
        with self._cv:
            self.failed = self.failed or why or f"exited with status {code}"
            self._cv.notify_all()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        with self._cv:
            self._cv.wait_for(lambda: self.ready is not None or self.failed is not None, timeout_s)
            if self.ready is None and self.failed is None:
                self.failed = f"not ready after {timeout_s:g} s (still importing)"
                kill_group(self.proc.pid)
            return self.failed is None

    def _send(self, kind: str, **fields) -> None:
        data = memoryview(gate_fork.encode(kind, **fields))
        with self._wlock:
            while data:
                data = data[os.write(self._req, data) :]

    def run(
        self,
        target: str,
        argv: list[str],
        env: dict[str, str],
        out_path: Path,
        timeout_s: float,
        stall: Stall | None = None,
    ) -> ProcessRun:
        """The case process forked, supervised as runner.supervise would: killed (its group) at timeout_s or when its
        Stall watch says it hangs. Raises ForkUnavailable when nothing started, ForkServerDied when the forkserver
        died under the case."""
        if target != TARGET_MAIN:
            raise ValueError(f"a gate forkserver runs {TARGET_MAIN}, not {target}")
        if not self.wait_ready():
            raise ForkUnavailable(f"forkserver {self.failed}")
        with self._cv:
            rid, self._next = self._next, self._next + 1
            ev = self._events.setdefault(rid, {})
        Path(out_path).write_bytes(self.import_log)
        t0 = time.time()
        try:
            self._send(gate_fork.RUN, id=rid, argv=argv, env=env, out=str(out_path), argv0=_gate_file())
        except OSError as e:
            raise ForkUnavailable(f"forkserver gone ({e})") from None
        with self._cv:
            self._cv.wait_for(
                lambda: gate_fork.STARTED in ev or gate_fork.NOT_STARTED in ev or self.failed, ANSWER_TIMEOUT_S
            )
            started, refused, failed = ev.get(gate_fork.STARTED), ev.get(gate_fork.NOT_STARTED), self.failed
        if started is None:
            if refused is None and failed is None:
                self.fail(f"no answer to a case request in {ANSWER_TIMEOUT_S:g} s")
            raise ForkUnavailable(refused["reason"] if refused else f"forkserver {self.failed}")
        pid = started["pid"]
        timed_out = hung = False
        try:
            while True:  # in slices, so that the stall watch looks at the case's output every second
                with self._cv:
                    left = max(0.0, t0 + timeout_s - time.time())
                    self._cv.wait_for(lambda: gate_fork.EXITED in ev or self.failed, min(1.0, left))
                    done = gate_fork.EXITED in ev
                if done or self.failed or not left:
                    break
                if stall is not None and stall.check(time.time()):
                    hung = True
                    break
            if not done and self.failed:
                kill_group(pid)  # an orphan now: no case outlives the launcher that watched it
                raise ForkServerDied(f"forkserver died while the case ran ({self.failed})")
            if not done:
                timed_out = True
                self._kill(rid, pid)
                with self._cv:
                    self._cv.wait_for(lambda: gate_fork.EXITED in ev or self.failed, KILL_WAIT_S)
        except BaseException:  # Ctrl-C or an error in the gate: leave no case running
            self._kill(rid, pid)
            raise
        code = ev[gate_fork.EXITED]["returncode"] if gate_fork.EXITED in ev else None
        return ProcessRun(code, timed_out, False, time.time() - t0, t0, stalled=hung)

    def _kill(self, rid: int, pid: int) -> None:
        with contextlib.suppress(OSError):
            self._send(gate_fork.KILL, id=rid)
        kill_group(pid)

    def fail(self, why: str) -> None:
        with self._cv:
            self.failed = self.failed or why
            self._cv.notify_all()
        kill_group(self.proc.pid)

    def close(self) -> None:
        self.closing = True
        with contextlib.suppress(OSError):
            self._send(gate_fork.STOP)
        with contextlib.suppress(OSError):
            os.close(self._req)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()


def _gate_file() -> str:
    """sys.argv[0] of `python -m repro.vllm_integration.gate.worker`: the module's file."""
    import importlib.util  # noqa: PLC0415  only when a forked case starts

    return str(importlib.util.find_spec("repro.vllm_integration.gate.worker").origin)


def preload_list(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    extra = (os.environ if environ is None else environ).get(PRELOAD_ENV, "")
    return gate_fork.PRELOAD + tuple(x.strip() for x in extra.split(",") if x.strip())


class Launcher:
    """The gate run's launcher: which case processes are forked (and from which build's forkserver) and which are
    spawned, with a note for every change from what was asked (summary)."""

    def __init__(self, kind: str, log_dir: str | Path, preload: tuple[str, ...] | None = None) -> None:
        self.kind = kind
        self.log_dir = Path(log_dir)
        self.preload = preload or preload_list()
        self._servers: dict[object, ForkServer] = {}
        self._lock = threading.RLock()
        self._stats: dict[str, dict] = {}

    def _stat(self, label: str) -> dict:
        return self._stats.setdefault(label, {"forked": 0, "spawned": 0, "notes": []})

    def start(self, build, env: dict[str, str]) -> ForkServer | None:
        """The build's forkserver, started with this case environment (less LATE_VARS) unless it runs already; None
        when the launcher spawns or the build has no package folder to import."""
        if self.kind != FORK:
            return None
        with self._lock:
            if build in self._servers:
                return self._servers[build]
            pkg = build.package_dir
            if pkg is None or not pkg.is_dir():
                self._note(build.label, "no vllm package folder to pre-import: its cases are launched plainly")
                self._servers[build] = None
                return None
            log = self.log_dir / f"forkserver-{build.label}.log"
            self._servers[build] = server = ForkServer(build.label, env, log, self.preload)
            return server

    def server_for(self, build, env: dict[str, str]) -> tuple[ForkServer | None, str | None]:
        """(the forkserver to fork this case from, None) or (None, why it is launched plainly: None when spawning is
        what was asked)."""
        if self.kind != FORK:
            return None, None
        server = self.start(build, env)
        if server is None:
            return None, "no vllm package folder to pre-import"
        if not server.wait_ready():
            self._note(build.label, f"forkserver {server.failed}: its cases are launched plainly", once=True)
            return None, f"forkserver {server.failed}"
        diff = differs(env, server.launch_env, server.ready.get("read_late") or ())
        if diff:
            return None, f"{', '.join(diff)} differ from the forkserver's environment (read at import)"
        return server, None

    def launch(self, case, cmd: list[str], env: dict[str, str], log_dir: Path, sanitized: bool, run_process):
        """One case process through `run_process` (repro.run.runner's, as gate_run holds it): forked from its build's
        forkserver where it can be, else spawned as `cmd`. (result, output, what the record's phases get: the
        launcher that started it and, when that is not the one asked for, why)."""
        server, why = (None, "memcheck runs under compute-sanitizer") if sanitized else self.server_for(case.build, env)
        if server is not None:
            try:
                res, out = run_process(case, cmd, env, log_dir, False, server, (TARGET_MAIN, cmd[3:]))
                self.count(case.build.label, True)
                # what a spawned process would have spent importing, paid once by the build's forkserver
                return res, out, {"launcher": FORK, "preimported_s": server.ready.get("import_s")}
            except ForkServerDied as e:
                why = str(e)
                self._note(case.build.label, f"forkserver died under {case.case_id}: it ran again, launched plainly")
            except ForkUnavailable as e:
                why = str(e)
        res, out = run_process(case, cmd, env, log_dir, sanitized)
        self.count(case.build.label, False, why, case.case_id)
        return res, out, {"launcher": SPAWN, **({"launch_note": why} if why and self.kind == FORK else {})}

    def count(self, label: str, forked: bool, why: str | None = None, case_id: str = "") -> None:
        with self._lock:
            s = self._stat(label)
            s["forked" if forked else "spawned"] += 1
            if why and self.kind == FORK:
                s["notes"].append(f"{case_id}: launched plainly: {why}")

    def _note(self, label: str, text: str, once: bool = False) -> None:
        with self._lock:
            notes = self._stat(label)["notes"]
            if not (once and text in notes):
                notes.append(text)

    def summary(self) -> dict[str, dict]:
        """Per build: the launcher asked for, the case processes forked and spawned, the forkserver's import time
        and facts (threads, what the imports set), and every note."""
        out = {}
        for build, server in self._servers.items():
            s = self._stat(build.label)
            if server is not None and server.ready:
                r = server.ready
                s["forkserver"] = {
                    k: r.get(k) for k in ("pid", "import_s", "native_threads", "python_threads", "driver")
                }
                s["forkserver"]["env_set"] = sorted(r.get("env_set") or {})
                s["forkserver"]["read_late"] = r.get("read_late") or []
                if r.get("read_late"):
                    self._note(
                        build.label,
                        f"Python code read {', '.join(r['read_late'])} while the forkserver imported: a case that sets "
                        "another value is launched plainly",
                        once=True,
                    )
                s["forkserver"]["ready_after_s"] = round((server.ready_at or server.t0) - server.t0, 1)
            if (
                server is not None
                and server.failed
                and not server.closing
                and not any("forkserver" in n for n in s["notes"])
            ):
                s["notes"].append(f"forkserver {server.failed}")
        for label, s in self._stats.items():
            out[label] = {"launcher": self.kind, **s}
        return out

    def close(self) -> None:
        for server in [s for s in self._servers.values() if s is not None]:
            server.close()
