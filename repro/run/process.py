"""One case process, whoever starts it (repro.run.runner, repro.run.executor, repro.run.forkserver): its base
environment, the body of a warm memcheck process's case, reaping a forkserver's children, killing a case's session, and
the record of how it ran (ProcessRun)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from repro import CHECKOUT, entrypoints

# The longest wait a command takes (a case's timeout, a run's deadline, a kept forkserver's idle time): one week.
# Python's waits overflow past about 24.8 days (poll's milliseconds in a C int): a longer --timeout was taken, then
# ended the run with an OverflowError once its first case waited.
MAX_WAIT_S = 7 * 24 * 3600


@contextlib.contextmanager
def undisturbed() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP held off while a command stops its processes (a closed terminal sends SIGHUP twice,
    a user presses Ctrl-C twice: the second would cut the stop short and leave processes running). Only the main
    thread can set handlers: elsewhere nothing is held."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    was = {sig: signal.signal(sig, signal.SIG_IGN) for sig in sigs}
    try:
        yield
    finally:
        for sig, handler in was.items():
            signal.signal(sig, handler)


def case_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment every case process starts from (`base`, default this process's): unbuffered output, and this
    checkout first on the Python path, so that the harness imports from wherever the command runs. A forkserver is
    started with it too (repro.run.executor, repro.run.server)."""
    env = dict(os.environ if base is None else base)
    env["PYTHONUNBUFFERED"] = "1"
    root = str(CHECKOUT)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def reaped() -> Iterator[tuple[int, int]]:
    """(pid, exit code) of every child of this process that has ended, without waiting for one still running (a
    signal's exit is its negative number): how a forkserver learns its cases' exits."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # no child left
            return
        if pid == 0:  # children left, none ended
            return
        yield pid, os.waitstatus_to_exitcode(status)


@dataclass
class ProcessRun:
    """How a case process ended, as its parent saw it."""

    returncode: int | None
    timed_out: bool
    stopped_early: bool  # killed EARLY_STOP_GRACE_S (repro.run.runner) after memcheck's first finding
    wall_s: float
    started_at: float = 0.0  # when the parent started the process (time.time())
    stalled: bool = False  # killed by its Stall watch (timed_out is set too: a hang)


@dataclass(frozen=True)
class StallRule:
    """When a case process counts as hung before its timeout: its output has not grown for quiet_s once `marker`
    appeared in it (the vLLM gate: CUDA graph capture began, after which a healthy case prints every second)."""

    marker: str
    quiet_s: float


STALLED = "stalled: no output"  # how a hang its Stall watch stopped begins its reason


class Stall:
    """Watches one case's output file under a StallRule; check(now) is True once the process is stalled."""

    def __init__(self, out_path: str | Path, rule: StallRule) -> None:
        self.path, self.rule = Path(out_path), rule
        self.marker = rule.marker.encode()
        self.size, self.since, self.armed = -1, 0.0, False

    def check(self, now: float) -> bool:
        try:
            size = os.path.getsize(self.path)
        except OSError:
            return False
        if size != self.size:
            if not self.armed:  # the new bytes, and the marker's length before them (a marker split over writes)
                with open(self.path, "rb") as f:
                    f.seek(max(0, self.size - len(self.marker)))
                    self.armed = self.marker in f.read()
            self.size, self.since = size, now
            return False
        return self.armed and now - self.since > self.rule.quiet_s

    def why(self) -> str:
        return f"{STALLED} for {self.rule.quiet_s:g} s after {self.rule.marker!r} (killed as hung)"


def run_child(target: str, argv: list[str], env: dict[str, str], out_path: str) -> None:
    """Become the case process of a warm memcheck process (repro.run.executor.WarmPool): output to out_path, the
    case's environment, run, exit."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)  # before anything initializes CUDA: device pinning, MPS, allocator settings
    code = 1
    try:
        code = entrypoints.load(target)(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command's name (state, ppid, pgrp, ...: a name may hold spaces and
    parentheses, so they are read after its last ')'); None where the file cannot be read (no such process, no /proc)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def kill_group(pid: int) -> None:
    """SIGKILL a case process's session (it leads one) with everything it started; gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
