"""What the process-management tests ask of the process table: is a process (or a process group) still there."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def gone(pid: int, within_s: float = 5.0) -> bool:
    """Has the process ended within `within_s`?"""
    for _ in range(int(within_s / 0.1)):
        if not alive(pid):
            return True
        time.sleep(0.1)
    return not alive(pid)


def group_alive(pgid: int) -> bool:
    """Is any process of the process group still running?"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def at_a_terminal() -> None:
    """A Popen preexec_fn for a process a test interrupts with Ctrl-C: SIGINT's default action, as a shell gives its
    foreground job. A test run started in the background of a non-interactive shell (`cmd &` in a script, as CI may
    do) inherits SIGINT ignored, and so would every process it starts: its Ctrl-C would then never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
