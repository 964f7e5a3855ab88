"""The vLLM gate's forkserver: one process per vLLM build that imports torch, vLLM and the harness's plugin modules
once, without starting CUDA, and forks one gate case process per request (repro.vllm_integration.gate.launch is the
gate's side of it).

  python -m repro.vllm_integration.gate.fork --requests FD --replies FD [--preload MODULE[:ATTR],...]
  python -m repro.vllm_integration.gate.fork --socket PATH --idle S [--preload ...]   kept for later runs (listen)

Started with its build's environment (PYTHONPATH with the build's prefix and torch, the gate's BASE_ENV), less what
differs per case (gate_forkserver.LATE_VARS). After its imports it refuses to serve (a REFUSED record, then it exits)
when torch or the CUDA driver was initialised, when vLLM cached its environment or loaded its plugins, or when an
import set a per-case variable. The per-case variables Python code read while importing are in its READY record
(`read_late`): a case that sets another value for one of them is launched plainly (gate_forkserver.differs). Else it
forks a child per RUN request, each of which:
- asserts again (before the fork) that torch has not initialised CUDA;
- starts a session of its own (the gate kills the whole group at the timeout), restores Ctrl-C, sends stdout and
  stderr to the case's log (appended: the gate wrote the forkserver's import output there first, as a fresh process
  would have printed it), reads nothing from stdin;
- takes the case's environment whole, plus what the imports set (vLLM's env_override: PYTORCH_NVML_BASED_CUDA_CHECK,
  TORCHINDUCTOR_COMPILE_THREADS, ...), before anything starts CUDA or loads the plugin;
- runs repro.vllm_integration.gate.worker's main as `python -m repro.vllm_integration.gate.worker` would, and ends as that process
  ends (the interpreter's own exit: non-daemon threads joined, atexit handlers run, so the plugin's exit reports
  are written; an exception's traceback and exit 1).
The forkserver reaps each child and reports its exit status (negative: the signal); it kills its children's groups
when the gate closes its request pipe or says STOP. Records are JSON lines with a schema and a kind (KINDS), never
text to parse."""

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
RUN, KILL, STOP = "run", "kill", "stop"  # gate -> forkserver
READY, REFUSED, STARTED, EXITED, NOT_STARTED = "ready", "refused", "started", "exit", "not-started"  # and back
KINDS = frozenset({RUN, KILL, STOP, READY, REFUSED, STARTED, EXITED, NOT_STARTED})
TARGET = entrypoints.GATE_WORKER  # what a case process runs (its main)
PRELOAD = entrypoints.GATE_PRELOAD  # what a case process imports before its engine starts
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


def _vllm_problems() -> list[str]:
    out = []
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        getter = vars(envs).get("__getattr__")
        if hasattr(getter, "__wrapped__") or vars(envs).get("_env_cache") is not None:
            out.append("vLLM's environment cache is on (enable_envs_cache): a case's variables would not be read")
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None and vars(plugins).get("plugins_loaded"):
        out.append("vLLM loaded its general plugins while importing: the plugin would not see a case's environment")
    counters = sys.modules.get(entrypoints.PLUGIN_COUNTERS)
    if counters is not None and getattr(counters, "_installed", None):
        out.append(f"the plugin installed {sorted(counters._installed)} in the forkserver")
    return out


def prepare(preload: list[str], late: frozenset[str]) -> tuple[dict, list[str]]:
    """Import everything in `preload` (MODULE or MODULE:ATTR) and check the process can fork cases: (the READY
    record's facts, the problems that refuse it)."""
    before = dict(os.environ)
    real, watched = os.environ, _WatchedEnviron(os.environ, late)
    os.environ = watched  # noqa: B003  the same environment, watched: os.getenv reads the module's environ too
    t0 = time.time()
    from repro.vllm_integration.releases.builds import add_site_dirs  # the forkserver's imports are its cases'

    add_site_dirs()  # before the preloads: the build's .pth files take effect in the cases it forks
    try:
        for item in preload:
            entrypoints.load(item)
    finally:
        watched.watching = False
        os.environ = real  # noqa: B003  the same data: a module that kept the watched one sees every change
    import_s = time.time() - t0
    env_set = {k: v for k, v in os.environ.items() if before.get(k) != v}
    env_unset = sorted(set(before) - set(os.environ))
    problems = [p for p in (cuda_problem(),) if p] + _vllm_problems()
    if set(env_set) & late or set(env_unset) & late:
        problems.append(f"the imports set per-case variables: {sorted((set(env_set) | set(env_unset)) & late)}")
    try:
        native = len(os.listdir("/proc/self/task"))
    except OSError:
        native = None
    facts = {
        "pid": os.getpid(),
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


def serve(req_fd: int, rep_fd: int, listener: socket.socket | None = None) -> dict | None:
    """Answer requests until told to stop (None) or until this is a forked child, which gets its RUN request (a
    child closes the request and reply descriptors and the listener). A run that connects to the listener meanwhile
    is told at once that this forkserver is busy (REFUSED): it starts or spawns its own."""
    children: dict[int, int] = {}  # pid -> request id
    sel = selectors.DefaultSelector()
    sel.register(req_fd, selectors.EVENT_READ)
    if listener is not None:
        sel.register(listener, selectors.EVENT_READ)
    buf = b""
    try:
        while True:
            eof = False
            for key, _ in sel.select(timeout=0.05):
                if key.fileobj is listener:
                    _busy(listener)
                    continue
                chunk = os.read(req_fd, 1 << 16)
                eof = not chunk
                buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                msg = decode(line)
                if msg["kind"] == STOP:
                    return None
                if msg["kind"] == KILL:
                    pid = next((p for p, i in children.items() if i == msg["id"]), None)
                    if pid is not None:
                        _kill_all({pid: msg["id"]})
                    continue
                if msg["kind"] != RUN:
                    raise ProtocolError(f"a forkserver takes run, kill and stop, not {msg['kind']!r}")
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
            if eof:  # the gate closed its end (it ended, or was killed): no case outlives it
                return None
    finally:
        if children:  # the forkserver's own exit (not a child's return)
            _kill_all(children)


def _busy(listener: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn, _ = listener.accept()
        with conn:
            conn.setblocking(True)
            conn.sendall(encode(REFUSED, reason="busy: it serves another gate run", busy=True))


def listen(path: str, idle_s: float, facts: dict, refusal: str | None) -> dict | None:
    """--socket: a forkserver that outlives the gate run that started it (gate_keep). It serves one gate run at a
    time, each a connection to the Unix socket at `path`, whose first record is READY (the facts, how many runs it
    served) or REFUSED; a run's end (STOP, or its connection closing) kills what it left running, and the next run
    may connect. After idle_s without a connection it removes its socket and exits. Returns None when it stops, the
    RUN request in a forked child."""
    started, served = time.time(), 0
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    sock.bind(path)
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
                _send(fd, encode(READY, **facts, kept_s=idle_s, served=served, started=round(started, 3)))
                msg = serve(fd, fd, listener=sock)
            except OSError:  # the run went away mid-record: its cases were killed; wait for the next run
                msg = None
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
    os.setsid()
    if msg.get(
        "cwd"
    ):  # the gate's folder: relative paths in argv and env are its (a kept forkserver started elsewhere)
        os.chdir(msg["cwd"])
    fd = os.open(msg["out"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    env = {**msg["env"], **facts["env_set"]}
    for k in facts["env_unset"]:
        env.pop(k, None)
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")  # as gate.py's __main__ does
    sys.argv = [msg.get("argv0") or TARGET, *msg["argv"]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m repro.vllm_integration.gate.fork")
    p.add_argument("--requests", type=int, help="file descriptor the gate writes requests to")
    p.add_argument("--replies", type=int, help="file descriptor this process answers on")
    p.add_argument("--socket", help="instead: serve gate runs one at a time at this Unix socket (listen)")
    p.add_argument("--idle", type=float, default=600.0, help="with --socket: seconds without a run before it exits")
    p.add_argument("--preload", default=",".join(PRELOAD), help="MODULE[:ATTR],... (default: PRELOAD)")
    p.add_argument("--late", default="", help="the per-case variables (gate_forkserver.LATE_VARS), comma-separated")
    a = p.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the gate stops it; its own session keeps the terminal's ^C off
    if (a.socket is None) == (a.requests is None or a.replies is None):
        p.error("give --requests and --replies, or --socket")
    late = frozenset(x for x in a.late.split(",") if x)
    try:
        facts, problems = prepare([x for x in a.preload.split(",") if x], late)
    except BaseException as e:  # an import that fails: the build's cases are launched plainly
        traceback.print_exc()
        facts, problems = {}, [f"import failed: {type(e).__name__}: {e}"[:500]]
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
    code = entrypoints.load(TARGET).main(msg["argv"])
    gc.freeze()  # what the case made, too: its exit walks none of it (as the spawned worker's)
    return code


if __name__ == "__main__":
    sys.exit(main())
