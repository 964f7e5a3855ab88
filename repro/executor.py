"""Case processes forked from a server that imported torch and the harness once (Python's forkserver), instead of a
fresh `python -m repro.worker` per case. The server never touches CUDA, so every case still gets a CUDA context of
its own (a sticky CUDA error cannot leak into another case); what a case saves is the interpreter start and the
imports. Opt-in (`matrix --executor forkserver`); memcheck cases always run as their own program under
compute-sanitizer. Each forked case runs in a process session of its own, so a timeout or Ctrl-C kills it with
everything it started."""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path

PRELOAD = ("torch", "repro.worker", "repro.backends.preload")


def _child(target: str, argv: list[str], env: dict[str, str], out_path: str) -> None:
    os.setsid()
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)  # before anything initializes CUDA: device pinning, MPS, allocator settings
    module, _, func = target.partition(":")
    code = 1
    try:
        code = getattr(importlib.import_module(module), func)(argv) or 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


class ForkServer:
    """Runs `module:function(argv)` in a forked case process, output to a file, under a timeout."""

    name = "forkserver"

    def __init__(self, preload: tuple[str, ...] = PRELOAD) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(list(preload))

    def run(self, target: str, argv: list[str], env: dict[str, str], out_path: Path, timeout_s: float):
        from repro.runner import ProcessRun

        t0 = time.time()
        proc = self.ctx.Process(target=_child, args=(target, argv, dict(env), str(out_path)), daemon=False)
        proc.start()
        timed_out = False
        try:
            proc.join(timeout_s)
            if proc.is_alive():
                timed_out = True
                _kill(proc)
        except BaseException:  # Ctrl-C in the parent: no orphan case left running
            _kill(proc)
            raise
        return ProcessRun(proc.exitcode, timed_out, False, time.time() - t0, t0)


def _kill(proc) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.join()


EXECUTORS = ("process", "forkserver")
DEFAULT_EXECUTOR = "forkserver"


def make_executor(name: str) -> ForkServer | None:
    """None: a fresh interpreter per case (the default); forkserver: ForkServer."""
    from repro.descriptors import ConfigError

    if name == "process":
        return None
    if name == "forkserver":
        return ForkServer()
    raise ConfigError(f"unknown executor {name!r}; choose from {', '.join(EXECUTORS)}")
