"""What the pytest GPU tier shares across its cases within one process: the run's log folder (one per run, one
sub-folder per xdist worker, so no two processes ever write one file) and the case executor (a forkserver that
imported torch and the FA3 libraries once, or the repro server when one runs this code: the matrix's fast path)."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from pathlib import Path

RUN_ENV = "REPRO_RUN_LOG_DIR"  # set once by the controller; xdist workers inherit it
_executor = None
_lock = threading.Lock()


def start_run_logs(worker: str, environ=os.environ) -> Path:
    """The folder this process writes case logs to: REPRO_LOG_DIR (or the temp folder)/pytest-<time>-<pid>/<worker>.
    The controller names the run; workers started after it inherit the name."""
    run = environ.get(RUN_ENV)
    if not run:
        base = environ.get("REPRO_LOG_DIR") or os.path.join(tempfile.gettempdir(), "repro-pytest-logs")
        run = os.path.join(base, time.strftime("pytest-%Y%m%d-%H%M%S") + f"-{os.getpid()}")
        environ[RUN_ENV] = run
    return Path(run) / (worker or "main")


def log_dir() -> Path:
    return start_run_logs(os.environ.get("PYTEST_XDIST_WORKER", ""))


def case_executor():
    """This process's executor, started at its first GPU case (a forkserver, or the repro server running this code);
    REPRO_EXECUTOR=process gives each case a fresh interpreter."""
    if os.environ.get("REPRO_EXECUTOR") == "process":
        return None
    with _lock:
        return _executor or _start_executor()


def _start_executor():
    global _executor
    if _executor is None:
        from repro.run.runner import default_executor  # at the first GPU case: CPU runs never load it

        _executor = default_executor(jobs=1)
    return _executor


def warm_up(first_spec) -> threading.Thread:
    """In the background, while pytest collects and schedules: start this process's executor (the forkserver imports
    torch and the FA3 libraries) and import the CPU model the expectations need, so the first case waits for
    neither (each was ~4 s per xdist worker on the H200)."""

    def work() -> None:
        with contextlib.suppress(Exception):  # the first case reports whatever fails here, with its reason
            from repro.judge.expectations import (
                expectation,  # the CPU model (numpy) in the background, as the docstring says
            )

            expectation(first_spec)
            ex = case_executor()
            if ex is not None and hasattr(ex, "start"):
                ex.start()

    t = threading.Thread(target=work, name="repro-warm-up", daemon=True)
    t.start()
    return t


def close_case_executor() -> None:
    global _executor
    if _executor is not None:
        _executor.close()
        _executor = None
