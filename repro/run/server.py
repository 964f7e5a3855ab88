"""A case server that outlives the command (`python -m repro serve`): torch, the harness and the FA3 libraries
imported once, then one forked case process per request, as the forkserver does inside one command (repro.run.executor).
Importing torch alone takes ~4 s on an H200 machine, so no command that starts from nothing shows a verdict in under
3 s; with a server up, `matrix` forks its cases from it (its first positive control: ~2 s of fork, CUDA start and
kernels). Memcheck cases never come from it (each needs a compute-sanitizer of its own: repro.run.executor.WarmPool).

A server serves only commands that would import the same code: its fingerprint (the harness's sources, the
interpreter, the FA3 libraries the environment names) must equal the command's, or the command does not use
it (after an edit, `serve` starts a new one). It stops after `idle_s` without a request, on `serve --stop`, or when its
socket is removed. Each case still runs in a process (and process session) of its own, with its own environment and
CUDA context; a command that dies or is interrupted takes its running cases with it.

Protocol: one JSON line per request on a Unix socket; `run` answers {"pid"} at the fork and {"exit"} when the case
process ended (the connection stays open meanwhile: closing it kills the case); `ping` answers the server's facts;
`stop` ends it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import selectors
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from repro import CHECKOUT, PACKAGE, entrypoints
from repro.errors import ConfigError
from repro.run.executor import PRELOAD, MemcheckAhead
from repro.run.process import ProcessRun, exit_code, kill_group, reaped, run_child

SOCKET_ENV = "REPRO_SERVER"  # the socket to use instead of the default one, or "off": never use a server
DEFAULT_IDLE_S = 1800.0
START_TIMEOUT_S = 120.0
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes, the last one NUL


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


def code_fingerprint(preload: tuple[str, ...] = PRELOAD) -> str:
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


# ---- the server process


def serve(path: Path, idle_s: float, preload: tuple[str, ...]) -> None:
    t0 = time.time()
    for module in preload:
        entrypoints.load(module)
    facts = {
        "pid": os.getpid(),
        "fingerprint": code_fingerprint(preload),
        "preload_s": round(time.time() - t0, 2),
        "started": t0,
        "idle_s": idle_s,
    }
    path.parent.mkdir(mode=0o700, exist_ok=True)  # never the folders above it (docs/outputs.md)
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(srv, selectors.EVENT_READ)
    cases: dict[int, socket.socket] = {}  # pid -> the connection waiting for its exit
    last = time.time()
    asked_to_stop = False
    try:
        while path.exists():
            for key, _ in sel.select(timeout=0.05):
                if key.fileobj is srv:
                    conn, _ = srv.accept()
                    last = time.time()
                    if _request(conn, srv, sel, cases, facts) == "stop":
                        asked_to_stop = True  # the command that asked tidies up (stop()), after the socket went
                        return
                else:  # a waiting client closed its connection (Ctrl-C, timeout): its case goes with it
                    conn = key.fileobj
                    pid = next((p for p, c in cases.items() if c is conn), None)
                    if pid is not None:
                        kill_group(pid)
                        cases[pid] = None
                    sel.unregister(conn)
                    conn.close()
            _reap(sel, cases)
            if cases:
                last = time.time()
            elif time.time() - last > idle_s:
                return
    finally:
        for pid in cases:
            kill_group(pid)
        srv.close()
        with contextlib.suppress(FileNotFoundError):
            if path.exists() and path.is_socket():
                path.unlink()
        if sys.exc_info()[0] is None and not asked_to_stop:  # idle; after an exception the log keeps the traceback
            tidy(path)


def _request(conn, srv, sel, cases, facts) -> str | None:
    conn.settimeout(10)
    try:
        req = json.loads(conn.makefile("r").readline() or "{}")
    except (OSError, ValueError):
        conn.close()
        return None
    op = req.get("op")
    if op in ("ping", "stop"):
        with contextlib.suppress(OSError):
            conn.sendall((json.dumps(facts) + "\n").encode())
        conn.close()
        return op
    if op != "run":
        conn.close()
        return None
    pid = os.fork()
    if pid == 0:  # the case process: nothing of the server's
        with contextlib.suppress(Exception):
            sel.close()
            srv.close()
            for c in cases.values():
                if c is not None:
                    c.close()
            conn.close()
        run_child(req["target"], req["argv"], req["env"], req["out"])  # never returns
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    conn.settimeout(None)
    cases[pid] = conn
    sel.register(conn, selectors.EVENT_READ)
    return None


def _reap(sel, cases) -> None:
    if not cases:
        return
    for pid, code in reaped():
        conn = cases.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall((json.dumps({"exit": code}) + "\n").encode())
            sel.unregister(conn)
            conn.close()
        if not cases:  # every case reaped: other children are not this loop's to wait for
            return


# ---- the command's side


def _ask(path: Path, request: dict, timeout_s: float = 5.0) -> dict | None:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout_s)
            s.connect(str(path))
            s.sendall((json.dumps(request) + "\n").encode())
            line = s.makefile("r").readline()
    except OSError:
        return None
    return json.loads(line) if line else None


def running(path: Path | None = None) -> dict | None:
    """The facts of the server listening at `path` (default: socket_path()), or None."""
    path = path or socket_path()
    if not path or not path.exists() or path.parent.stat().st_uid != os.getuid():
        return None  # none, or another user's folder: never hand cases (and their environment) to it
    return _ask(path, {"op": "ping"})


def start(path: Path, idle_s: float = DEFAULT_IDLE_S, preload: tuple[str, ...] = PRELOAD) -> dict:
    """Start a server in the background (a session of its own) and wait until it answers."""
    check_socket_path(path)
    try:
        path.parent.mkdir(mode=0o700, exist_ok=True)  # never the folders above it (docs/outputs.md)
    except OSError as e:
        raise ConfigError(f"{SOCKET_ENV}: cannot make the socket's folder {path.parent} ({e.strerror or e})") from None
    if path.parent.stat().st_uid != os.getuid():
        raise ConfigError(f"{path.parent} belongs to another user: choose a socket with {SOCKET_ENV}=/path/to.sock")
    log = path.with_suffix(".log")
    cmd = entrypoints.command(entrypoints.SERVER, str(path), str(idle_s), ",".join(preload))
    env = dict(os.environ)
    root = str(CHECKOUT)  # importable from wherever the command runs
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = None
    try:
        with open(log, "w") as f:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        return _wait_started(proc, path, log)
    except BaseException:  # Ctrl-C while it starts: the server started here stops (its own session never sees it)
        if proc is not None:
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if path.is_socket():  # checked before: absent or a socket, now this server's
            path.unlink()
        tidy(path)
        raise


def _wait_started(proc: subprocess.Popen, path: Path, log: Path) -> dict:
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
            return facts
        time.sleep(0.1)
    proc.kill()
    raise ConfigError(f"the repro server did not answer within {START_TIMEOUT_S:g} s (its log: {log})")


def stop(path: Path) -> dict | None:
    """Stop the server at `path` and remove what it left (its log, the default socket folder when empty); its facts,
    or None when none ran."""
    facts = running(path)
    if facts:
        _ask(path, {"op": "stop"})
        for _ in range(100):
            if not path.exists():
                break
            time.sleep(0.05)
    if not path.exists():
        tidy(path)
    return facts


def tidy(path: Path) -> None:
    """Remove a stopped server's log, and the default socket folder (repro-<uid>) once it is empty."""
    with contextlib.suppress(OSError):
        path.with_suffix(".log").unlink()
    if path.parent.name == f"repro-{os.getuid()}":
        with contextlib.suppress(OSError):
            path.parent.rmdir()


class ServerExecutor(MemcheckAhead):
    """Cases forked by a running server (same interface as repro.run.executor.ForkServer)."""

    name = "server"

    def __init__(self, path: Path, facts: dict, spares: int = 4) -> None:
        super().__init__(PRELOAD, spares)
        self.path, self.facts = path, facts
        self.started_by = f"the repro server (pid {facts['pid']})"  # for reports: what started the cases

    def run(self, target: str, argv: list[str], env: dict[str, str], out_path: Path, timeout_s: float):
        t0 = time.time()
        Path(out_path).write_bytes(b"")
        request = {"op": "run", "target": target, "argv": argv, "env": dict(env), "out": str(out_path)}
        timed_out, pid, code = False, None, None
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            try:
                s.connect(str(self.path))
                s.sendall((json.dumps(request) + "\n").encode())
                lines = s.makefile("r")
                pid = _answer(lines).get("pid")
                if pid is not None:
                    s.settimeout(max(0.1, timeout_s - (time.time() - t0)))
                    try:
                        code = _answer(lines).get("exit")
                    except TimeoutError:
                        timed_out = True
                        kill_group(pid)
                        s.settimeout(30)
                        code = _answer(lines).get("exit")
            except BaseException as e:  # Ctrl-C in the command: the case goes too (and the server sees it leave)
                if pid is not None:
                    kill_group(pid)
                if not isinstance(e, OSError):
                    raise
        if pid is None or (code is None and not timed_out):  # the server went away: the case's outcome is unknown
            with open(out_path, "a") as f:
                f.write(f"the repro server at {self.path} stopped answering (case process {pid})\n")
        return ProcessRun(exit_code(code, out_path), timed_out, False, time.time() - t0, t0)


def _answer(lines) -> dict:
    line = lines.readline()
    return json.loads(line) if line.strip() else {}


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
    if facts["fingerprint"] != code_fingerprint():
        return None, (
            f"the repro server at {path} (pid {facts['pid']}) runs other code or FA3 libraries than this command "
            "(restart it: python -m repro serve)"
        )
    return facts, ""


if __name__ == "__main__":  # python -m repro.run.server SOCKET IDLE_S MODULE[,MODULE...]: started by start()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C in the terminal that started it is not for it
    serve(Path(sys.argv[1]), float(sys.argv[2]), tuple(m for m in sys.argv[3].split(",") if m))
