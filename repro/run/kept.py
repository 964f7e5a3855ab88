"""Forkservers that outlive the gate run that started them (`gate --launcher fork --keep-forkserver S`, issue 29).
A warm gate run is mostly its forkservers' import of torch and vLLM (17-27 s on the H200, results/h200-importtime)
before its first case can fork. With S given, a build's forkserver serves gate runs one at a time at a Unix socket
(repro.vllm_integration.gate.fork.listen) and exits once S seconds pass without one; a later run with the same
forkserver finds it and forks its cases at once.

Which forkserver a run may take is in the socket's name: a hash of the build's label, the forkserver's whole
environment (the Python path, the build's prefix, torch's), what it preloads, the per-case variables, and the
harness's own sources (repro.run.server.code_fingerprint). Any change starts another forkserver. An earlier one that
was not taken idles out. The socket and the forkserver's log (its import output, which each case's log starts with)
sit in this user's folder (socket_dir)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import socket
import subprocess
import time
from pathlib import Path

from repro.errors import ConfigError, ProtocolError
from repro.run.process import MAX_WAIT_S
from repro.run.server import code_fingerprint, private_dir
from repro.vllm_integration.gate import fork as gate_fork

KEEP_ENV = "REPRO_GATE_KEEP_FORKSERVER"  # --keep-forkserver's default (seconds; unset or 0: none)
CONNECT_POLL_S = 0.1


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


def socket_for(
    label: str, launch_env: dict[str, str], preload: tuple[str, ...], late: frozenset[str], identity: str = ""
) -> Path:
    """The socket of the forkserver a run with this build (identity: build_identity), environment and preload may
    take."""
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
    return socket_dir() / f"{safe}-{digest}.sock"


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
            [*cmd, "--socket", str(path), "--idle", f"{idle_s:g}"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
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
    """Is this first record the forkserver's answer that it serves another run (fork._busy)?"""
    try:
        rec = gate_fork.decode(line)
    except ProtocolError:  # not a record: the reader says so
        return False
    return rec["kind"] == gate_fork.REFUSED and rec.get("busy") is True  # its flag, never its reason's words


def log_of(path: Path) -> Path:
    return path.with_suffix(".log")
