"""The harness's one forkserver: a process that imports what its cases need once (torch, the FA3 libraries, vLLM:
whatever its preload names), without starting CUDA, and forks one case process per request. Every path that forks
its cases uses it: the attention layer's matrix and pytest tier (repro.run.executor), the repro server that outlives
commands (repro.run.server, a kept forkserver) and the vLLM gate, one per build (repro.vllm_integration.gate.launch).
repro.run.forkclient is the starting command's side of it.

  python -m repro.run.forkserver --requests FD --replies FD --preload MODULE[:ATTR],... [--late VARS]
      [--setup MODULE:FUNC] [--checks MODULE:FUNC] [--tag TEXT]
  python -m repro.run.forkserver --socket PATH --idle S ...     kept: serves runs one at a time (listen)

Started with its cases' environment less what differs per case (the client's LATE_VARS). `--setup` is called before
the imports (the gate: the build's site folders). After its imports it refuses to serve (a REFUSED record, then it
exits) when torch or the CUDA driver was initialised, when `--checks` names problems (the gate: vLLM cached its
environment or loaded its plugins), or when an import set a per-case variable. The per-case variables Python code read
while importing are in its READY record (`read_late`): a case that sets another value for one of them is launched
plainly (forkclient.differs). Else it forks a child per RUN request, each of which:
- asserts again (before the fork) that torch has not initialised CUDA;
- starts a session of its own (its client kills the whole group at the timeout), restores Ctrl-C, sends stdout and
  stderr to the case's log (appended: the client wrote the forkserver's import output there first, as a fresh process
  would have printed it), reads nothing from stdin;
- takes the case's environment whole, plus what the imports set (vLLM's env_override: PYTORCH_NVML_BASED_CUDA_CHECK,
  TORCHINDUCTOR_COMPILE_THREADS, ...), before anything starts CUDA;
- runs the request's target (`module:function`, called with its argv) as `python -m module` would, and ends as that
  process ends (the interpreter's own exit: non-daemon threads joined, atexit handlers run, so a plugin's exit reports
  are written; an exception's traceback and exit 1).
The forkserver reaps each child and reports its exit status (negative: the signal); it kills its children's groups
when the client closes its request pipe or says STOP. Kept (`--socket`), a client's STOP or closed connection ends
that run (its cases killed) and the next may connect; SHUTDOWN ends the forkserver. Records are JSON lines with a
schema and a kind (KINDS), never text to parse."""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
import traceback

from repro import entrypoints
from repro.errors import ProtocolError
from repro.run.process import reaped

SCHEMA = 1
RUN, KILL, STOP, SHUTDOWN = "run", "kill", "stop", "shutdown"  # client -> forkserver
READY, REFUSED, STARTED, EXITED, NOT_STARTED = "ready", "refused", "started", "exit", "not-started"  # and back
KINDS = frozenset({RUN, KILL, STOP, SHUTDOWN, READY, REFUSED, STARTED, EXITED, NOT_STARTED})
CUDA_NOT_INITIALIZED = 3  # CUresult of a driver call before cuInit


def encode(kind: str, **fields) -> bytes:
    if kind not in KINDS:
        raise ProtocolError(f"unknown record kind {kind!r}")
    return (json.dumps({"schema": SCHEMA, "kind": kind, **fields}) + "\n").encode()


def decode(line: bytes | str) -> dict:
    try:
        rec = json.loads(line)
    except ValueError as e:
        raise ProtocolError(f"not JSON: {str(line)[:120]!r}") from e
    if not isinstance(rec, dict) or rec.get("schema") != SCHEMA or rec.get("kind") not in KINDS:
        raise ProtocolError(f"not a record of schema {SCHEMA}: {str(line)[:120]!r}")
    return rec


class _WatchedEnviron(os._Environ):
    """os.environ that notes the variables Python code reads (get, [], in) while `watching` is set: the forkserver
    must know whether an import read a variable that differs per case. Shares the real environ's data."""

    def __init__(self, real: os._Environ, watch: frozenset[str]) -> None:
        super().__init__(real._data, real.encodekey, real.decodekey, real.encodevalue, real.decodevalue)
        self.watch, self.read, self.watching = watch, set(), True

    def __getitem__(self, key):
        if self.watching and key in self.watch:
            self.read.add(key)
        return super().__getitem__(key)


def driver_state() -> str:
    """Whether this process started the CUDA driver (cuInit), without starting it: `not loaded` (libcuda.so is not
    mapped), `loaded` (mapped, a driver call answers CUDA_ERROR_NOT_INITIALIZED) or `initialised`."""
    try:
        with open("/proc/self/maps") as f:
            paths = {ln.split()[-1] for ln in f if "libcuda.so" in ln}
    except OSError:
        return "unknown"
    if not paths:
        return "not loaded"
    try:
        lib = ctypes.CDLL(sorted(paths)[0])  # already loaded: the same handle, nothing initialised by this
        n = ctypes.c_int(0)
        code = lib.cuDeviceGetCount(ctypes.byref(n))
    except (OSError, AttributeError):
        return "unknown"
    return "loaded" if code == CUDA_NOT_INITIALIZED else "initialised" if code == 0 else f"unknown (CUresult {code})"


def cuda_problem() -> str | None:
    """Why this process must not fork a case: torch or the driver initialised CUDA (a forked child cannot use it)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "torch initialised CUDA in the forkserver"
    if driver_state() == "initialised":
        return "the CUDA driver was initialised (cuInit) in the forkserver"
    return None


def prepare(
    preload: list[str], late: frozenset[str], setup: str | None = None, checks: str | None = None
) -> tuple[dict, list[str]]:
    """Call `setup`, import everything in `preload` (MODULE or MODULE:ATTR) and check the process can fork cases (CUDA
    not started, `checks`' problems, no per-case variable set): (the READY record's facts, the problems that refuse
    it)."""
    before = dict(os.environ)
    real, watched = os.environ, _WatchedEnviron(os.environ, late)
    os.environ = watched  # noqa: B003  the same environment, watched: os.getenv reads the module's environ too
    t0 = time.time()
    try:
        if setup:  # before the preloads (the gate: the build's .pth files take effect in the cases it forks)
            entrypoints.load(setup)()
        for item in preload:
            entrypoints.load(item)
    finally:
        watched.watching = False
        os.environ = real  # noqa: B003  the same data: a module that kept the watched one sees every change
    import_s = time.time() - t0
    env_set = {k: v for k, v in os.environ.items() if before.get(k) != v}
    env_unset = sorted(set(before) - set(os.environ))
    problems = [p for p in (cuda_problem(),) if p] + (list(entrypoints.load(checks)()) if checks else [])
    if set(env_set) & late or set(env_unset) & late:
        problems.append(f"the imports set per-case variables: {sorted((set(env_set) | set(env_unset)) & late)}")
    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:
        native = None
    facts = {
        "pid": os.getpid(),
        "launch_env": before,  # what it was started with: a client compares its cases' with it (forkclient.why_not)
        "import_s": round(import_s, 2),
        "preload": list(preload),
        "env_set": env_set,
        "env_unset": env_unset,
        "read_late": sorted(watched.read),  # per-case variables read while importing: they must equal the case's
        "python_threads": sorted(t.name for t in threading.enumerate()),
        "native_threads": native,
        "driver": driver_state(),
        "torch": getattr(sys.modules.get("torch"), "__version__", None),
        "vllm": getattr(sys.modules.get("vllm"), "__version__", None),
    }
    return facts, problems


def _send(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _kill_all(children: dict[int, int]) -> None:
    for pid in children:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


SHUT = {"kind": SHUTDOWN}  # serve's answer when a kept forkserver was told to end (never a case's request)


def serve(req_fd: int, rep_fd: int, listener: socket.socket | None = None, facts: dict | None = None) -> dict | None:
    """Answer requests until told to stop (None; SHUT for SHUTDOWN) or until this is a forked child, which gets its
    RUN request (a child closes the request and reply descriptors and the listener). A run that connects to the
    listener meanwhile is told at once that this forkserver is busy (REFUSED, with its facts): it starts or spawns its
    own."""
    children: dict[int, int] = {}  # pid -> request id
    sel = selectors.DefaultSelector()
    sel.register(req_fd, selectors.EVENT_READ)
    if listener is not None:
        sel.register(listener, selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            eof = waiting = False
            for key, _ in sel.select(timeout=0.05):
                if key.fileobj is listener:  # answered after this run's own records: a STOP before it ends the run
                    waiting = True
                    continue
                chunk = os.read(req_fd, 1 << 16)
                eof = not chunk
                buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = decode(line)
                if msg["kind"] in (STOP, SHUTDOWN):
                    return SHUT if msg["kind"] == SHUTDOWN else None
                if msg["kind"] == KILL:
                    pid = next((p for p, i in children.items() if i == msg["id"]), None)
                    if pid is not None:
                        _kill_all({pid: msg["id"]})
                    continue
                if msg["kind"] != RUN:
                    raise ProtocolError(f"a forkserver takes run, kill, stop and shutdown, not {msg['kind']!r}")
                problem = cuda_problem()
                if problem:
                    _send(rep_fd, encode(NOT_STARTED, id=msg["id"], reason=problem))
                    continue
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    sel.close()
                    for fd in {req_fd, rep_fd}:
                        os.close(fd)
                    if listener is not None:
                        listener.close()
                    children.clear()
                    return msg
                children[pid] = msg["id"]
                _send(rep_fd, encode(STARTED, id=msg["id"], pid=pid, at=time.time()))
            _reap(children, rep_fd)
            if eof:  # the client closed its end (it ended, or was killed): no case outlives it
                return None
            if waiting:
                _busy(listener, facts or {})
    finally:
        if children:  # the forkserver's own exit (not a child's return)
            _kill_all(children)


def _busy(listener: socket.socket, facts: dict) -> None:
    with contextlib.suppress(OSError):
        conn, _ = listener.accept()
        with conn:
            conn.setblocking(True)
            conn.sendall(encode(REFUSED, reason="busy: it serves another run", busy=True, facts=facts))


def listen(path: str, idle_s: float, facts: dict, refusal: str | None) -> dict | None:
    """--socket: a forkserver that outlives the run that started it (repro.run.kept). It serves one run at a time,
    each a connection to the Unix socket at `path`, whose first record is READY (the facts, how many runs it served)
    or REFUSED; a run's end (STOP, or its connection closing) kills what it left running, and the next run may
    connect; SHUTDOWN ends it. After idle_s without a connection it removes its socket and exits. Returns None when it
    stops, the RUN request in a forked child."""
    started, served = time.time(), 0
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock.bind(path)
    bound = os.stat(path).st_ino  # the socket this forkserver made: never another's, made since at the same path
    sock.listen(4)
    sock.settimeout(idle_s)
    child = False
    try:
        while True:
            try:
                conn, _ = sock.accept()
            except TimeoutError:
                return None
            fd = conn.detach()
            os.set_blocking(fd, True)
            if refusal is not None:
                _send(fd, encode(REFUSED, reason=refusal, facts=facts))
                os.close(fd)
                return None
            served += 1
            try:
                ready = {**facts, "kept_s": idle_s, "served": served, "started": round(started, 3)}
                _send(fd, encode(READY, **ready))
                msg = serve(fd, fd, listener=sock, facts=ready)
            except OSError:  # the run went away mid-record: its cases were killed; wait for the next run
                msg = None
            if msg is SHUT:
                return None
            if msg is not None:
                child = True
                return msg
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(ChildProcessError):
                while os.waitpid(-1, os.WNOHANG)[0]:  # the cases a closed run left killed
                    pass
    finally:
        if not child:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                if os.stat(path).st_ino == bound:
                    os.unlink(path)


def _reap(children: dict[int, int], rep_fd: int) -> None:
    if not children:
        return
    for pid, code in reaped():
        if pid in children:
            rid = children.pop(pid)
            _send(rep_fd, encode(EXITED, id=rid, pid=pid, returncode=code, at=time.time()))
        if not children:  # every case reaped: other children are not this loop's to wait for
            return


def become_case(msg: dict, facts: dict) -> None:
    """In the forked child: the case process's session, output, environment and argv (see the module)."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.setsid()
    fd = os.open(msg["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if msg.get("cwd"):  # the client's folder: relative paths in argv and env are its (a kept one started elsewhere)
        try:
            os.chdir(msg["cwd"])
        except OSError as e:  # gone since the command started: the case runs where it is, and its log says so
            print(f"repro forkserver: cannot enter the command's folder {msg['cwd']} ({e.strerror})", file=sys.stderr)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    env = {**msg["env"], **facts["env_set"]}
    for k in facts["env_unset"]:
        env.pop(k, None)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [msg.get("argv0") or msg["target"], *msg["argv"]]


def _terminated(signum, frame) -> None:
    raise SystemExit(0)


def _names(text: str) -> list[str]:
    return [x for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m repro.run.forkserver")
    p.add_argument("--requests", type=int, help="file descriptor the client writes requests to")
    p.add_argument("--replies", type=int, help="file descriptor this process answers on")
    p.add_argument("--socket", help="instead: serve runs one at a time at this Unix socket (listen)")
    p.add_argument("--idle", type=float, default=600.0, help="with --socket: seconds without a run before it exits")
    p.add_argument("--preload", default="", help="MODULE[:ATTR],... to import before the first case")
    p.add_argument("--late", default="", help="the per-case variables (the client's LATE_VARS), comma-separated")
    p.add_argument("--setup", help="MODULE:FUNC called before the imports")
    p.add_argument("--checks", help="MODULE:FUNC called after them: the problems that refuse this forkserver")
    p.add_argument("--tag", default="", help="text its READY record carries back (what the client started it for)")
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # its client stops it; its own session keeps the terminal's ^C off
    signal.signal(signal.SIGTERM, _terminated)  # `serve --stop` of a busy server: its cases killed, its socket removed
    if (a.socket is None) == (a.requests is None or a.replies is None):
        p.error("give --requests and --replies, or --socket")
    try:
        facts, problems = prepare(_names(a.preload), frozenset(_names(a.late)), a.setup, a.checks)
    except (SystemExit, KeyboardInterrupt):  # told to end while importing (SIGTERM, _terminated): not a failed import
        raise
    except BaseException as e:  # an import that fails: its cases are launched plainly
        traceback.print_exc()
        facts, problems = {"pid": os.getpid()}, [f"import failed: {type(e).__name__}: {e}"[:500]]
    facts["tag"] = a.tag
    sys.stdout.flush()
    sys.stderr.flush()
    # the imports' objects leave the collector's generations: a forked case neither walks them in its collections,
    # its last one at exit included (0.5 s of each forked case's end with torch loaded, on CPU), nor copies their pages
    gc.freeze()
    refusal = "; ".join(problems) if problems else None
    if a.socket is not None:
        msg = listen(a.socket, a.idle, facts, refusal)
    elif refusal is not None:
        _send(a.replies, encode(REFUSED, reason=refusal, facts=facts))
        return 3
    else:
        _send(a.replies, encode(READY, **facts))
        msg = serve(a.requests, a.replies)
    if msg is None:
        return 0
    become_case(msg, facts)
    code = entrypoints.load(msg["target"])(msg["argv"])
    gc.freeze()  # what the case made, too: its exit walks none of it (as the spawned worker's)
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
