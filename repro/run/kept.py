"""Forkservers that outlive the command that started them (repro.run.forkserver's `--socket`): the gate's kept
forkservers (`gate --keep-forkserver S`, one per build: repro.vllm_integration.gate.keep) and the repro server
(`python -m repro serve`: repro.run.server). A warm gate run is mostly its forkservers' import of torch and vLLM
(17-27 s on the H200) before its first case can fork; a kept one serves runs one at a time at a Unix socket and exits
once its idle time passes without one, so a later run finds it and forks its cases at once.

The gate's: which forkserver a run may take is in the socket's name (socket_for): a hash of its label, its whole
environment (the Python path, a build's prefix, torch's), what it preloads, the per-case variables, the identity of
what it imports and the harness's own sources (code_fingerprint). Any change starts another. Those sockets and their
forkservers' logs (the import output, which each case's log starts with) sit in this user's folder (private_dir). The
repro server's socket is one per checkout instead (repro.run.server.socket_path): its fingerprint travels in its
READY record (its --tag), and the environment it started with too, with which each case is compared."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from repro import CHECKOUT, PACKAGE
from repro.errors import ProtocolError
from repro.run import forkserver

CONNECT_POLL_S = 0.1


def user_dir() -> Path:
    """This user's folder for the harness's sockets (the repro server's, the gate's kept forkservers')."""
    return Path(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"repro-{os.getuid()}"


def private_dir(name: str) -> Path:
    """user_dir()/name, each level made for this user alone; PermissionError when one is there that another user owns
    or others may enter (a socket or a library in it would be theirs to replace: the kept forkservers', memcheck:own's
    allocator)."""
    d = user_dir() / name
    for folder in (d.parent, d):  # each made for this user alone (parents=True would give the first the umask's)
        folder.mkdir(mode=0o700, exist_ok=True)
    for folder in (d.parent, d):
        st = folder.lstat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not stat.S_ISDIR(st.st_mode):
            raise PermissionError(f"{folder} is not this user's alone (owner, mode): remove it")
    return d


def code_fingerprint(preload: tuple[str, ...]) -> str:
    """What a forked case would run: the harness's sources (where, path, size, mtime), the interpreter, the FA3
    libraries the environment names, the modules preloaded."""
    h = hashlib.sha256()
    root = PACKAGE
    for f in sorted(root.rglob("*.py")):
        st = f.stat()
        h.update(f"{f.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(f"{root}\n{sys.executable}\n{','.join(preload)}\n".encode())
    for k in sorted(k for k in os.environ if k.startswith("FA3_")):
        h.update(f"{k}={os.environ[k]}\n".encode())
    return h.hexdigest()[:16]


def socket_for(
    folder: Path,
    label: str,
    launch_env: dict[str, str],
    preload: tuple[str, ...],
    late: frozenset[str],
    identity: str = "",
) -> Path:
    """The socket in `folder` of the forkserver a run with this label, what it imports (identity: the gate's
    build_identity), environment and preload may take."""
    key = json.dumps(
        {
            "label": label,
            "build": identity,
            "env": sorted(launch_env.items()),
            "preload": list(preload),
            "late": sorted(late),
        },
        sort_keys=True,
    )
    digest = hashlib.sha256(f"{key}\n{code_fingerprint(preload)}".encode()).hexdigest()[:20]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in label)[:24]
    return folder / f"{safe}-{digest}.sock"


def try_connect(path: Path) -> socket.socket | None:
    """A connection to the forkserver at path, or None when none listens there."""
    if not path.is_socket():
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
    except OSError:
        s.close()
        return None
    return s


def start(cmd: list[str], env: dict[str, str], path: Path, idle_s: float) -> subprocess.Popen:
    """A forkserver listening at path (cmd: its command line without the transport), in a session of its own, so
    that it outlives this run; its output goes to path's log."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    with open(log_of(path), "wb") as log:
        return subprocess.Popen(
            [*cmd, "--socket", os.path.abspath(path), "--idle", f"{idle_s:g}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=CHECKOUT,  # `python -m` puts its folder first on sys.path: the harness's, not the starting command's
        )


def wait_connect(path: Path, proc: subprocess.Popen | None, timeout_s: float) -> socket.socket | None:
    """A connection once the forkserver listens (it listens after its imports), None when it exited first or
    timeout_s passed."""
    end = time.time() + timeout_s
    while time.time() < end:
        s = try_connect(path)
        if s is not None:
            return s
        if proc is not None and proc.poll() is not None:
            return None
        time.sleep(CONNECT_POLL_S)
    return None


BUSY_WAIT_S = 3.0  # a forkserver that just served a run takes a moment to notice its end


def take(sock: socket.socket | None, path: Path, proc: subprocess.Popen | None, timeout_s: float):
    """(a connection, its first record's line, the connection's reader) to the forkserver at path: READY, or REFUSED
    other than busy; a forkserver that answers busy is asked again for BUSY_WAIT_S. Nones when none answers."""
    end, busy_end = time.time() + timeout_s, time.time() + BUSY_WAIT_S
    while True:
        if sock is None:
            sock = wait_connect(path, proc, max(0.0, end - time.time()))
            if sock is None:
                return None, None, None
        reader = sock.makefile("rb")
        first = reader.readline()
        if not _busy(first) or time.time() > busy_end:
            return sock, first, reader
        reader.close()
        sock.close()
        sock = None
        time.sleep(CONNECT_POLL_S)


def _busy(line: bytes) -> bool:
    """Is this first record the forkserver's answer that it serves another run (forkserver._busy)?"""
    try:
        rec = forkserver.decode(line)
    except ProtocolError:  # not a record: the reader says so
        return False
    return rec["kind"] == forkserver.REFUSED and rec.get("busy") is True  # its flag, never its reason's words


def log_of(path: Path) -> Path:
    return path.with_suffix(".log")
