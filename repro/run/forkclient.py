"""The gate's end of a build's forkserver (repro.vllm_integration.gate.fork is the forkserver's process): ForkServer
starts it with the build's environment less the per-case variables (LATE_VARS), or takes one an earlier run kept
(repro.vllm_integration.gate.keep), sends RUN, KILL and STOP records, and supervises each forked case as
repro.run.runner.supervise does a spawned one: its timeout, its stall watch, its whole group killed. `differs` says
which variables keep a case from forking from it (repro.vllm_integration.gate.launch decides)."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import threading
import time
from pathlib import Path

from repro import entrypoints
from repro.contract import request
from repro.contract.channel import ENV as CHANNEL_ENV
from repro.errors import ConfigError, ForkServerDied, ForkUnavailable, ProtocolError
from repro.run.process import ProcessRun, Stall, kill_group
from repro.vllm_integration.gate import fork as gate_fork
from repro.vllm_integration.gate import keep as gate_keep

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
        "TRITON_CACHE_DIR",  # read when a kernel compiles (vLLM's compile and JIT warmup), not at import
        CHANNEL_ENV,  # read at each record
        request.ENV,  # the case's request: read by the worker's main and by plugin.register when vLLM loads it
    }
)


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

    def __init__(
        self,
        label: str,
        env: dict[str, str],
        log_path: Path,
        preload: tuple[str, ...],
        keep_s: float | None = None,
        identity: str = "",
    ) -> None:
        self.label, self.launch_env, self.log_path = label, launch_env(env), Path(log_path)
        self.keep_s, self.kept = keep_s, False  # kept: an earlier run's forkserver (gate_keep), not started here
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
        cmd = entrypoints.command(entrypoints.GATE_FORK, "--preload", ",".join(preload))
        cmd += ["--late", ",".join(sorted(LATE_VARS))]
        if keep_s:
            try:
                self.socket = gate_keep.socket_for(label, self.launch_env, preload, LATE_VARS, identity)
            except (ConfigError, OSError) as e:  # no folder of this user's alone: its cases are launched plainly
                self.proc, self.failed = None, f"not kept: {e}"
                return
            sock = gate_keep.try_connect(self.socket)
            self.kept = sock is not None
            self.proc = None if self.kept else gate_keep.start(cmd, self.launch_env, self.socket, keep_s)
            threading.Thread(target=self._read_kept, args=(sock,), name=f"forkserver-{label}", daemon=True).start()
            return
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        cmd += ["--requests", str(req_r), "--replies", str(rep_w)]
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

    def _read_kept(self, sock) -> None:
        """A kept forkserver's records: connect first (to the one found, or once the one started here listens)."""
        sock, first, reader = gate_keep.take(sock, self.socket, self.proc, READY_TIMEOUT_S)
        if sock is None:
            with self._cv:
                self.failed = f"no forkserver listened at its socket in {READY_TIMEOUT_S:g} s"
                self._cv.notify_all()
            if self.proc is not None:
                kill_group(self.proc.pid)
            return
        self._sock, self._req, self._rep = sock, sock.fileno(), reader
        self._read(first)

    def _pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else (self.ready or {}).get("pid")

    def _read(self, first: bytes | None = None) -> None:
        why = None
        try:
            for line in itertools.chain([first] if first else [], self._rep):
                rec = gate_fork.decode(line)
                with self._cv:
                    if rec["kind"] == gate_fork.READY:
                        log = gate_keep.log_of(self.socket) if self.keep_s else self.log_path
                        self.import_log = log.read_bytes() if log.exists() else b""
                        if self.keep_s:  # the run's logs keep what the forkserver printed, as a fresh one's would
                            self.log_path.write_bytes(self.import_log)
                        self.ready, self.ready_at = rec, time.time()
                    elif rec["kind"] == gate_fork.REFUSED:
                        why = f"refused: {rec.get('reason')}"
                    elif "id" in rec:
                        self._events.setdefault(rec["id"], {})[rec["kind"]] = rec
                    self._cv.notify_all()
        except (ProtocolError, OSError, ValueError) as e:
            why = f"its records broke off: {e}"
            if self._pid():
                kill_group(self._pid())
        if self.keep_s:  # a kept forkserver outlives this connection: it is not waited for
            end = "its connection closed" if not self.closing else "this run ended"
        else:
            end = f"exited with status {self.proc.wait()}"
        with self._cv:
            self.failed = self.failed or why or end
            self._cv.notify_all()

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        with self._cv:
            self._cv.wait_for(lambda: self.ready is not None or self.failed is not None, timeout_s)
            if self.ready is None and self.failed is None:
                self.failed = f"not ready after {timeout_s:g} s (still importing)"
                if self.proc is not None:
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
            self._send(
                gate_fork.RUN,
                id=rid,
                argv=argv,
                env=env,
                out=str(Path(out_path).resolve()),
                argv0=_gate_file(),
                cwd=os.getcwd(),
            )
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
        if self._pid():
            kill_group(self._pid())

    def close(self) -> None:
        self.closing = True
        if self.keep_s:  # STOP ends this run's connection; the forkserver waits for the next run
            sock = getattr(self, "_sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    self._send(gate_fork.STOP)
                sock.close()
            if self.proc is not None and self.ready is None:  # started here and never ready: nobody will take it
                kill_group(self.proc.pid)
            return
        if self.ready is None:  # still importing (it reads requests once ready): stopped now, not after 10 s
            kill_group(self.proc.pid)
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
    return entrypoints.source(entrypoints.GATE_WORKER)
