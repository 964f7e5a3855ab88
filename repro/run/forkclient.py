"""The starting command's side of the harness's one forkserver (repro.run.forkserver is the forkserver's process):
ForkServer starts it with its cases' environment less the per-case variables (`late`), or takes one an earlier
command kept at a socket (repro.run.kept), sends RUN, KILL, STOP and SHUTDOWN records, and supervises each forked case
as repro.run.runner.supervise does a spawned one: its timeout, its stall watch, its whole group killed. `differs` says
which variables keep a case from forking from it; `why_not` says whether a case can fork from it at all (its users
launch that case plainly, and say why)."""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import threading
import time
from pathlib import Path

from repro import entrypoints
from repro.errors import ForkServerDied, ForkUnavailable, ProtocolError
from repro.run import forkserver as fs
from repro.run import kept
from repro.run.process import ProcessRun, Stall, kill_group

READY_TIMEOUT_S = 300.0  # a forkserver importing longer than this is given up (its cases launched plainly)
ANSWER_TIMEOUT_S = 60.0  # a RUN request without a STARTED or NOT_STARTED record by then: the forkserver is stuck
KILL_WAIT_S = 30.0  # after the kill at a timeout, how long to wait for the forkserver to report the exit


def launch_env(env: dict[str, str], late: frozenset[str], kept_late: frozenset[str] = frozenset()) -> dict[str, str]:
    """A forkserver's environment: a case's, less what differs per case (`kept_late` kept as the case has it)."""
    return {k: v for k, v in env.items() if k not in late or k in kept_late}


def differs(
    env: dict[str, str], launch: dict[str, str], late: frozenset[str], read_at_import=(), matters=None
) -> list[str]:
    """The variables in which a case's environment differs from its forkserver's: any but `late` (only those
    `matters(name)` says its imports read, when given), and those of `late` that Python code read while the
    forkserver imported."""
    keys = {k for k in (set(env) | set(launch)) - late if matters is None or matters(k)} | set(read_at_import)
    return sorted(k for k in keys if env.get(k) != launch.get(k))


def command(
    preload: tuple[str, ...], late: frozenset[str], tag: str = "", setup: str | None = None, checks: str | None = None
) -> list[str]:
    """The forkserver's command line, without its transport (pipes, or a socket: repro.run.kept.start)."""
    cmd = entrypoints.command(entrypoints.FORKSERVER, "--preload", ",".join(preload))
    cmd += ["--late", ",".join(sorted(late)), "--tag", tag]
    return cmd + [*(["--setup", setup] if setup else []), *(["--checks", checks] if checks else [])]


class ForkServer:
    """One forkserver process and the command's end of its pipes or socket. Thread-safe: a command's case threads
    share it."""

    def __init__(
        self,
        label: str,
        env: dict[str, str],
        log_path: Path | None,
        preload: tuple[str, ...],
        late: frozenset[str],
        targets: frozenset[str],
        *,
        setup: str | None = None,
        checks: str | None = None,
        tag: str = "",
        socket: Path | None = None,
        keep_s: float | None = None,
        may_start: bool = True,
        unavailable: str | None = None,
        matters=None,
    ) -> None:
        """`env`: the forkserver's environment (launch_env of its cases'); `targets`: the `module:function`s its cases
        may run. With `socket`, a kept one: taken when one listens there, else started there for keep_s (unless
        may_start is False: the repro server's clients never start one). `unavailable`: why none can be started (its
        cases are launched plainly). `matters`: which of the variables a case may not set otherwise (differs), when
        not all but `late`."""
        self.label, self.launch_env = label, dict(env)
        self.log_path = Path(log_path) if log_path is not None else None  # its output (None: a kept one's only)
        self.late, self.targets, self.matters = late, targets, matters
        self.keep_s = keep_s
        self.kept = False  # an earlier command's forkserver (repro.run.kept), not started here
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.ready: dict | None = None
        self.refusal: dict | None = None  # its REFUSED record, when it refused (busy: a kept one serving another run)
        self.ready_at: float | None = None
        self.closing = False
        self._closed = False  # close() done to its end
        self._req: int | None = None  # the request pipe or socket (None: closed or never opened)
        self.failed: str | None = None
        self.import_log = b""  # what its imports printed: each case's log starts with it, as a fresh process's does
        self._cv = threading.Condition()
        self._events: dict[int, dict[str, dict]] = {}
        self._next = 0
        self._wlock = threading.Lock()
        self.t0 = time.time()
        cmd = command(preload, late, tag, setup, checks)
        self.socket = socket
        if unavailable:
            self.proc, self.socket, self.failed = None, None, unavailable
            return
        if socket is not None:
            sock = kept.try_connect(socket)
            self.kept = sock is not None
            if self.kept or not may_start:
                self.proc = None
            else:
                self.proc = kept.start(cmd, self.launch_env, socket, keep_s or 0.0)
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
        wait = READY_TIMEOUT_S if self.proc is not None or sock is not None else 0.0
        sock, first, reader = kept.take(sock, self.socket, self.proc, wait)
        if sock is None:
            with self._cv:
                self.failed = (
                    f"no forkserver listened at its socket in {READY_TIMEOUT_S:g} s"
                    if self.proc is not None
                    else f"no forkserver listens at {self.socket}"
                )
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
                rec = fs.decode(line)
                with self._cv:
                    if rec["kind"] == fs.READY:
                        log = kept.log_of(self.socket) if self.socket is not None else self.log_path
                        self.import_log = log.read_bytes() if log.exists() else b""
                        if self.socket is not None and self.log_path is not None:  # the run's logs keep what it printed
                            self.log_path.write_bytes(self.import_log)
                        self.ready, self.ready_at = rec, time.time()
                        if isinstance(rec.get("launch_env"), dict):  # a kept one's own, not what this command assumed
                            self.launch_env = rec["launch_env"]
                    elif rec["kind"] == fs.REFUSED:
                        why = f"refused: {rec.get('reason')}"
                        self.refusal = rec
                    elif "id" in rec:
                        self._events.setdefault(rec["id"], {})[rec["kind"]] = rec
                    self._cv.notify_all()
        except (ProtocolError, OSError, ValueError) as e:
            why = f"its records broke off: {e}"
            if self._pid():
                kill_group(self._pid())
        if self.socket is not None:  # a kept forkserver outlives this connection: it is not waited for
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
        data = memoryview(fs.encode(kind, **fields))
        with self._wlock:
            if self._req is None:  # closed: its number may belong to another file by now
                raise OSError("the forkserver's connection is closed")
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
        if target not in self.targets:
            raise ValueError(f"this forkserver runs {', '.join(sorted(self.targets))}, not {target}")
        if not self.wait_ready():
            raise ForkUnavailable(f"forkserver {self.failed}")
        with self._cv:
            rid, self._next = self._next, self._next + 1
            ev = self._events.setdefault(rid, {})
        Path(out_path).write_bytes(self.import_log)
        t0 = time.time()
        try:
            self._send(
                fs.RUN,
                id=rid,
                target=target,
                argv=argv,
                env=env,
                out=str(Path(out_path).resolve()),
                argv0=entrypoints.source(target.partition(":")[0]),  # sys.argv[0] of `python -m module`
                cwd=os.getcwd(),
            )
        except OSError as e:
            raise ForkUnavailable(f"forkserver gone ({e})") from None
        with self._cv:
            self._cv.wait_for(lambda: fs.STARTED in ev or fs.NOT_STARTED in ev or self.failed, ANSWER_TIMEOUT_S)
            started, refused, failed = ev.get(fs.STARTED), ev.get(fs.NOT_STARTED), self.failed
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
                    self._cv.wait_for(lambda: fs.EXITED in ev or self.failed, min(1.0, left))
                    done = fs.EXITED in ev
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
                    self._cv.wait_for(lambda: fs.EXITED in ev or self.failed, KILL_WAIT_S)
        except BaseException:  # Ctrl-C or an error in the command: leave no case running
            self._kill(rid, pid)
            raise
        code = ev[fs.EXITED]["returncode"] if fs.EXITED in ev else None
        return ProcessRun(code, timed_out, False, time.time() - t0, t0, stalled=hung)

    def _kill(self, rid: int, pid: int) -> None:
        with contextlib.suppress(OSError):
            self._send(fs.KILL, id=rid)
        kill_group(pid)

    def fail(self, why: str) -> None:
        with self._cv:
            self.failed = self.failed or why
            self._cv.notify_all()
        if self._pid():
            kill_group(self._pid())

    def why_not(self, env: dict[str, str]) -> str | None:
        """None when a case with this environment can fork from this forkserver, else why not (it failed, or a
        variable read at import differs)."""
        if not self.wait_ready():
            return f"forkserver {self.failed}"
        diff = differs(env, self.launch_env, self.late, self.ready.get("read_late") or (), self.matters)
        return f"{', '.join(diff)} differ from the forkserver's environment (read at import)" if diff else None

    def shutdown(self) -> None:
        """A kept forkserver: end it (SHUTDOWN), not only this command's connection."""
        with contextlib.suppress(OSError):
            if self.wait_ready(READY_TIMEOUT_S):
                self._send(fs.SHUTDOWN)
        self.close()

    def close(self) -> None:
        """End this command's use of the forkserver (its cases killed). Safe to call again, also after a close that
        was cut short: each step is done once, and a descriptor closed here is never closed again (its number may
        be another file's by then)."""
        if self._closed:
            return
        self.closing = True
        if self.proc is None and self.socket is None:  # never started (unavailable)
            self._closed = True
            return
        if self.socket is not None:  # STOP ends this run's connection; the forkserver waits for the next run
            sock = getattr(self, "_sock", None)
            if sock is not None:
                with contextlib.suppress(OSError):
                    self._send(fs.STOP)
                with self._wlock:
                    self._req, self._sock = None, None
                sock.close()
            if self.proc is not None and self.ready is None:  # started here and never ready: nobody will take it
                kill_group(self.proc.pid)
            self._closed = True
            return
        if self.ready is None:  # still importing (it reads requests once ready): stopped now, not after 10 s
            kill_group(self.proc.pid)
        with contextlib.suppress(OSError):
            self._send(fs.STOP)
        with self._wlock:
            req, self._req = self._req, None
        if req is not None:
            with contextlib.suppress(OSError):
                os.close(req)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill_group(self.proc.pid)
            self.proc.wait()
        self._closed = True
