"""The gate's kept forkservers (`gate --launcher fork --keep-forkserver S`): how long they are kept, this
user's folder for them, and what says a build's files are the ones a kept forkserver imported. The mechanism is the
harness's one forkserver kept at a socket (repro.run.kept, repro.run.forkserver's listen)."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
from pathlib import Path

from repro.errors import ConfigError
from repro.run.kept import private_dir
from repro.run.process import MAX_WAIT_S

KEEP_ENV = "REPRO_GATE_KEEP_FORKSERVER"  # --keep-forkserver's default (seconds; unset or 0: none)


def keep_seconds(
    flag: float | None, forking: bool, environ: dict[str, str] | None = None, check_dir: bool = True
) -> float | None:
    """How long the run's forkservers are kept: --keep-forkserver (refused unless the run forks: the fork launcher,
    no --compare-paths), else KEEP_ENV where the run forks (ignored elsewhere); None for none. ConfigError for a
    value that is no duration, or a socket folder that is not this user's alone."""
    if flag and not forking:
        raise ConfigError(
            "--keep-forkserver keeps the fork launcher's forkservers: give --launcher fork, no --compare-paths"
        )
    text = ((os.environ if environ is None else environ).get(KEEP_ENV) or "").strip()
    value = flag
    if value is None and text and forking:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{KEEP_ENV}={text!r}: a number of seconds") from None
        if not math.isfinite(value) or not 0 <= value <= MAX_WAIT_S:
            raise ConfigError(f"{KEEP_ENV}={text!r}: a number of seconds, 0 to {MAX_WAIT_S} (a week)")
    if value and check_dir:  # a dry run makes no folder
        socket_dir()
    return value or None


def socket_dir() -> Path:
    """This user's folder of kept forkservers: made for this user alone (a case's whole environment passes through
    its sockets); ConfigError when one is there that another user owns or others may enter."""
    try:
        return private_dir("forkservers")
    except PermissionError as e:
        raise ConfigError(f"--keep-forkserver: {e}") from None


def build_identity(build) -> str:
    """What says a build's files are the ones a kept forkserver imported: its version, its torch, and the path, size
    and mtime of every Python module and extension under its package folder (a reinstall at the same prefix, and an
    edit of one module in place too: a bisect's checkout, a mutant, a hand-made fix, each of which a forkserver that
    imported the old file would run instead)."""
    pkg = build.package_dir
    h = hashlib.sha256()
    for root, dirs, files in os.walk(pkg) if pkg is not None else ():
        dirs.sort()
        for name in sorted(f for f in files if f.endswith((".py", ".so", ".pth"))):
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(root, name))
                h.update(f"{os.path.relpath(os.path.join(root, name), pkg)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return "|".join([str(build.version), str(build.torch_prefix or ""), str(pkg or ""), h.hexdigest()[:20]])
