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
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from repro.run.server import code_fingerprint

KEEP_ENV = "REPRO_GATE_KEEP_FORKSERVER"  # --keep-forkserver's default (seconds; unset or 0: none)
CONNECT_POLL_S = 0.1


def socket_dir() -> Path:
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    d = Path(base) / f"repro-{os.getuid()}" / "forkservers"
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    return d


def socket_for(label: str, launch_env: dict[str, str], preload: tuple[str, ...], late: frozenset[str]) -> Path:
    """The socket of the forkserver a run with this build, environment and preload may take."""
    key = json.dumps(
        {"label": label, "env": sorted(launch_env.items()), "preload": list(preload), "late": sorted(late)},
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


def log_of(path: Path) -> Path:
    return path.with_suffix(".log")
