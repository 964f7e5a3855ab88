"""The repro server (`python -m repro serve`): the harness's one forkserver (repro.run.forkserver) kept between commands
at a Unix socket, with torch, the harness and the FA3 libraries imported once. Importing torch alone takes ~4 s on an
H200 machine, so no command that starts from nothing shows a verdict in under 3 s; with a server up, `matrix` forks
its cases from it. Memcheck cases never come from it (each needs a compute-sanitizer of its own:
repro.run.executor.WarmPool).

A server serves only commands that would import the same code: its fingerprint (the harness's sources, the
interpreter, the FA3 libraries the environment names: repro.run.kept.code_fingerprint), carried back in its READY
record, must equal the command's, or the command does not use it (after an edit, `serve` starts a new one). It serves
one command at a time (a second one, told it is busy, forks from a forkserver of its own). It stops after `idle_s`
without a command, or on `serve --stop` (SHUTDOWN; SIGTERM while it serves a command). Each case still runs in a process (and
process session) of its own, with its own environment and CUDA context; a command that dies or is interrupted takes
its running cases with it (its connection closes)."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import time
from pathlib import Path

from repro import CHECKOUT
from repro.errors import ConfigError, ProtocolError
from repro.run import forkclient, forkserver, kept
from repro.run.executor import LATE_VARS, PRELOAD, TARGETS, ForkExecutor, read_at_import
from repro.run.kept import user_dir
from repro.run.process import case_env, stat_fields

SOCKET_ENV = "REPRO_SERVER"  # the socket to use instead of the default one, or "off": never use a server
DEFAULT_IDLE_S = 1800.0
START_TIMEOUT_S = 120.0
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, the last one NUL


def socket_path() -> Path | None:
    """Where this user's server for this checkout listens (None: REPRO_SERVER=off): one socket per checkout (a hash
    of its folder in the name), so `serve` in a second checkout never stops the first's server."""
    chosen = os.environ.get(SOCKET_ENV, "")
    if chosen == "off":
        return None
    if chosen:
        return Path(chosen)
    checkout = hashlib.sha256(str(CHECKOUT).encode()).hexdigest()[:8]
    return user_dir() / f"server-{checkout}.sock"


def check_socket_path(path: Path) -> None:
    """ConfigError when no server could listen at `path`: a Unix socket's path holds at most 107 bytes, and what is
    there already must be a socket (a server replaces it: never a user's file)."""
    if path.exists() and not path.is_socket():
        raise ConfigError(f"{SOCKET_ENV}: {path} exists and is not a socket: choose a path for the server's socket")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise ConfigError(
            f"the server's socket {path} is {len(os.fsencode(path))} bytes long, over the {MAX_SOCKET_PATH} a Unix "
            f"socket's path may hold: choose a shorter one with {SOCKET_ENV}=/path/to.sock"
        )


def code_fingerprint() -> str:
    """What a case forked from a server would run (repro.run.kept.code_fingerprint over the attention layer's
    preload)."""
    return kept.code_fingerprint(PRELOAD)


# ---- the command's side


def running(path: Path | None = None) -> dict | None:
    """The facts of the server listening at `path` (default: socket_path()), or None: its pid, fingerprint, when it
    started, its import time and idle time; `busy` when it serves another command now."""
    path = path or socket_path()
    if not path or not path.exists() or path.parent.stat().st_uid != os.getuid():
        return None  # none, or another user's folder: never hand cases (and their environment) to it
    sock = kept.try_connect(path)
    if sock is None:
        return None
    with sock:
        try:
            rec = _first_record(sock)
            if rec["kind"] == forkserver.READY:
                with contextlib.suppress(OSError):
                    sock.sendall(forkserver.encode(forkserver.STOP))
        except (OSError, ProtocolError):
            return None
    facts = rec if rec["kind"] == forkserver.READY else rec.get("facts") or {}
    if "pid" not in facts:
        return None
    busy = rec.get("busy") is True  # its flag, never its reason's words
    refused = rec["kind"] == forkserver.REFUSED and not busy
    return {
        "pid": facts["pid"],
        "fingerprint": facts.get("tag"),
        "preload_s": facts.get("import_s"),
        "started": facts.get("started", time.time()),
        "idle_s": facts.get("kept_s"),
        "busy": busy,
        "refused": rec.get("reason") if refused else None,  # it refused to serve (an import failed, CUDA started)
    }


def _first_record(sock, timeout_s: float = 5.0) -> dict:
    """A kept forkserver's first record to a connection: READY, or REFUSED (busy, or why it will not serve)."""
    sock.settimeout(timeout_s)
    with sock.makefile("rb") as lines:
        return forkserver.decode(lines.readline())


def start(path: Path, idle_s: float = DEFAULT_IDLE_S, preload: tuple[str, ...] = PRELOAD) -> dict:
    """Start a server in the background (a session of its own) and wait until it answers."""
    check_socket_path(path)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)  # never the folders above it (docs/outputs.md)
    except OSError as e:
        raise ConfigError(f"{SOCKET_ENV}: cannot make the socket's folder {path.parent} ({e.strerror or e})") from None
    if path.parent.stat().st_uid != os.getuid():
        raise ConfigError(f"{path.parent} belongs to another user: choose a socket with {SOCKET_ENV}=/path/to.sock")
    cmd = forkclient.command(preload, LATE_VARS, tag=kept.code_fingerprint(preload))
    env = forkclient.launch_env(case_env(), LATE_VARS)  # as a command's own forkserver (repro.run.executor)
    proc = None
    try:
        proc = kept.start(cmd, env, path, idle_s)
        return _wait_started(proc, path, kept.log_of(path))
    except BaseException:  # Ctrl-C while it starts: the server started here stops (its own session never sees it)
        if proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if path.is_socket():  # checked before: absent or a socket, now this server's
            path.unlink()
        tidy(path)
        raise


def _wait_started(proc, path: Path, log: Path) -> dict:
    t0 = time.time()
    while time.time() - t0 < START_TIMEOUT_S:
        if proc.poll() is not None:
            try:
                text = log.read_text(errors="replace")
            except OSError:  # it ran and stopped (idle) before this loop saw it answer: its log went with it
                text = ""
            tail = text.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]
            tidy(path)  # a refused start leaves nothing: its last line is in the message
            raise ConfigError(f"the repro server did not start: {tail[0]}")
        facts = running(path)
        if facts and facts["pid"] == proc.pid:
            if facts["refused"]:
                proc.wait(timeout=10)  # it exits once it has said why
                tidy(path)
                raise ConfigError(f"the repro server did not start: it refused to serve: {facts['refused']}")
            return facts
        time.sleep(0.1)
    proc.kill()
    raise ConfigError(f"the repro server did not answer within {START_TIMEOUT_S:g} s (its log: {log})")


def stop(path: Path) -> dict | None:
    """Stop the server at `path` (SHUTDOWN when it is free; SIGTERM when it serves a command, whose cases go with it)
    and remove what it left (its log, the default socket folder when empty); its facts, or None when none ran.
    ConfigError when it still runs after STOP_WAIT_S."""
    facts = running(path)
    if facts:
        said = False
        sock = kept.try_connect(path)
        if sock is not None:
            with sock, contextlib.suppress(OSError, ProtocolError):
                if _first_record(sock)["kind"] == forkserver.READY:
                    sock.sendall(forkserver.encode(forkserver.SHUTDOWN))
                    said = True
        if not said:  # busy, or gone quiet: it is ours (the socket's folder is this user's: running)
            with contextlib.suppress(OSError):
                os.kill(facts["pid"], signal.SIGTERM)
        end = time.time() + STOP_WAIT_S
        while time.time() < end and _alive(facts["pid"]):
            time.sleep(0.05)
        if _alive(facts["pid"]):
            raise ConfigError(f"the repro server (pid {facts['pid']}) did not stop within {STOP_WAIT_S:g} s")
    if not path.exists():
        tidy(path)
    return facts


STOP_WAIT_S = 10.0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = stat_fields(pid)  # a zombie (its parent, the command that started it, has not reaped it) has stopped
    return not fields or fields[0] != "Z"


def tidy(path: Path) -> None:
    """Remove a stopped server's log, and the default socket folder (repro-<uid>) once it is empty."""
    with contextlib.suppress(OSError):
        path.with_suffix(".log").unlink()
    if path.parent.name == f"repro-{os.getuid()}":
        with contextlib.suppress(OSError):
            path.parent.rmdir()


class ServerExecutor(ForkExecutor):
    """Cases forked by a running server (the same executor as a command's own forkserver, kept at its socket); when
    the server is taken by another command by the time this one connects, or has gone, from a forkserver of this
    command's own, and its notes say so."""

    name = "server"

    def __init__(self, path: Path, facts: dict, spares: int = 4, targets=TARGETS) -> None:
        super().__init__(case_env(), PRELOAD, spares, targets)
        self.path, self.facts = path, facts
        self.started_by = f"the repro server (pid {facts['pid']})"  # for reports: what started the cases

    def _make(self) -> forkclient.ForkServer:
        """The server's forkserver; when it is busy with another command since usable() asked, or gone, one of this
        command's own."""
        launch = forkclient.launch_env(self.env, LATE_VARS)
        served = forkclient.ForkServer(
            "server",
            launch,
            None,
            self.preload,
            LATE_VARS,
            self.targets,
            socket=self.path,
            may_start=False,
            matters=read_at_import,
        )
        if served.wait_ready():
            return served
        served.close()
        self.started_by = f"a forkserver of its own (the repro server: {served.failed})"
        return self._own()


def server_executor(jobs: int = 4) -> tuple[ServerExecutor | None, str]:
    """(an executor for the server this command may use, "") or (None, why not)."""
    facts, why = usable()
    return (ServerExecutor(socket_path(), facts, spares=jobs) if facts else None), why


def usable(path: Path | None = None) -> tuple[dict | None, str]:
    """(facts, "") of a server this command may use, or (None, why not)."""
    path = path or socket_path()
    if path is None:
        return None, f"{SOCKET_ENV}=off"
    facts = running(path)
    if facts is None:
        return None, f"no repro server at {path} (start one: python -m repro serve)"
    if facts["busy"]:
        return None, f"the repro server at {path} (pid {facts['pid']}) serves another command now"
    if facts["refused"]:
        return None, f"the repro server at {path} (pid {facts['pid']}) refused to serve: {facts['refused']}"
    if facts["fingerprint"] != code_fingerprint():
        return None, (
            f"the repro server at {path} (pid {facts['pid']}) runs other code or FA3 libraries than this command "
            "(restart it: python -m repro serve)"
        )
    return facts, ""
