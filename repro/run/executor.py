"""How case processes start when they need not start from nothing (`matrix --executor forkserver`, the default).

- Plain cases are forked from the harness's one forkserver (repro.run.forkserver, through repro.run.forkclient), which
  imported torch, the harness and the FA3 libraries once, instead of a fresh `python -m repro.attention.worker` per
  case. It never touches CUDA, so every case still gets a CUDA context of its own (a sticky CUDA error cannot leak into
  another case); what a case saves is the interpreter start and the imports. Each forked case runs in a process
  session of its own, so a timeout or Ctrl-C kills it with everything it started. A case whose environment differs
  from the forkserver's in a variable read when a process starts or imports (read_at_import: the Python path and the
  interpreter's, the FA3 libraries', torch's and its allocator's, the locale's, the thread pools'), or in a per-case
  variable its imports read, is started fresh instead, and the executor's notes say why and which.
- Or from the repro server, the same forkserver kept between commands (repro.run.server, `python -m repro serve`).
- Memcheck cases each need a compute-sanitizer of their own. One sanitizer over a forking server does follow the
  forked children (`--target-processes all`, tried on the H200 with compute-sanitizer 2025.3), but writes every
  process's errors into one log (`--log-file %p` is the sanitizer's pid), without saying which process made them,
  under one print limit for all.
  So a memcheck case still runs as its own sanitized program, but one started AHEAD of its case (WarmPool): it
  imports torch and the FA3 libraries under compute-sanitizer while other cases run, then waits on stdin for the one
  case it will run. The case's environment reaches it before CUDA starts (MPS, the GPU to use); what must be fixed
  at import time (the allocator, the Python path) must equal the environment it was started with, or the case runs
  in a fresh program as before."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from repro import entrypoints
from repro.contract.channel import ENV as CHANNEL_ENV
from repro.errors import ForkServerDied, ForkUnavailable
from repro.run import forkclient
from repro.run.process import kill_group, run_child
from repro.run.sanitizer import find_sanitizer, sanitizer_command

PRELOAD = entrypoints.EXECUTOR_PRELOAD
EXECUTORS = ("process", "forkserver", "server")  # what make_executor (repro.run.runner) can start cases with
DEFAULT_EXECUTOR = "forkserver"  # or the repro server, when one runs this very code (repro.run.runner.default_executor)


class MemcheckAhead:
    """What every executor does for memcheck cases: start their processes ahead of them (WarmPool)."""

    def __init__(self, preload: tuple[str, ...], spares: int) -> None:
        self.preload = preload
        self.spares = spares  # memcheck processes kept started ahead (prepare), normally the matrix's jobs
        self.warm: WarmPool | None = None

    def prepare(self, specs, launch_env: dict[str, str]) -> None:
        """Start memcheck processes ahead of the sanitized cases among `specs`."""
        n = sum(1 for s in specs if getattr(s, "sanitizer", False))
        if n and self.warm is None:
            # two more than its cases: a case the MPS server refused runs again in a process of its own
            self.warm = WarmPool(launch_env, spares=self.spares, budget=n + 2, preload=self.preload)

    def close(self) -> None:
        if self.warm is not None:
            self.warm.close()
            self.warm = None


TARGETS = frozenset({entrypoints.ATTENTION_WORKER_MAIN, entrypoints.SPEC_WORKER_MAIN})  # what its cases run


def read_at_import(name: str) -> bool:
    """Is this a variable the forkserver's imports read (IMPORT_VARS), so that a case with another value of it must not
    fork from it? Every other variable of the case reaches its process before anything reads it."""
    return name in IMPORT_VARS or name.startswith(IMPORT_PREFIXES)


IMPORT_VARS = frozenset(
    {"LD_LIBRARY_PATH", "LD_PRELOAD", "LANG", "LANGUAGE", "CUDA_MODULE_LOADING", "CUDA_HOME", "CUDA_PATH"}
)
# the interpreter's own (PYTHONPATH, PYTHONHASHSEED, PYTHONWARNINGS, ...), the locale's, the FA3 libraries', torch's
# and its allocator's, and the thread pools' (OpenMP, MKL, OpenBLAS): each is read when the process starts or imports
IMPORT_PREFIXES = ("PYTHON", "LC_", "FA3_", "TORCH", "PYTORCH_", "OMP_", "MKL_", "KMP_", "OPENBLAS_")


class ForkExecutor(MemcheckAhead):
    """Runs `module:function(argv)` in a case process forked from the harness's forkserver, output to a file, under a
    timeout; run() returns None when the case cannot fork (its caller starts it fresh, and `notes` say why and
    which cases)."""

    name = "forkserver"
    started_by = "a forkserver"  # for reports: what started the cases

    def __init__(
        self, env: dict[str, str], preload: tuple[str, ...] = PRELOAD, spares: int = 4, targets=TARGETS
    ) -> None:
        """`env`: the environment of a case on the whole GPU (repro.run.process.case_env): the forkserver's."""
        super().__init__(preload, spares)
        self.env, self.targets = dict(env), targets
        self.server: forkclient.ForkServer | None = None
        self.dir: Path | None = None
        self.fresh: dict[str, list[str]] = {}  # why cases were started fresh instead -> their output files' names
        self._lock = threading.Lock()

    @property
    def notes(self) -> list[str]:
        """Each reason a case was started fresh instead of forked, with the cases (their logs' names)."""
        return [f"{why} ({', '.join(cases)})" for why, cases in self.fresh.items()]

    def _own(self) -> forkclient.ForkServer:
        """A forkserver of this command's own, started now."""
        self.dir = Path(tempfile.mkdtemp(prefix="repro-fork-"))
        launch = forkclient.launch_env(self.env, LATE_VARS)
        return forkclient.ForkServer(
            "attention",
            launch,
            self.dir / "forkserver.log",
            self.preload,
            LATE_VARS,
            self.targets,
            matters=read_at_import,
        )

    def _make(self) -> forkclient.ForkServer:
        """The forkserver its cases fork from, made at the first case (or start)."""
        return self._own()

    def _server(self) -> forkclient.ForkServer:
        with self._lock:
            if self.server is None:
                self.server = self._make()
            return self.server

    def start(self) -> None:
        """Start the forkserver (it imports the preloaded modules) now instead of at the first case."""
        self._server()

    def run(self, target: str, argv: list[str], env: dict[str, str], out_path: Path, timeout_s: float):
        server = self._server()
        why = server.why_not(env)  # only the variables read at import count (matters), and the per-case ones read
        if why is None:
            try:
                return server.run(target, argv, env, out_path, timeout_s)
            except (ForkUnavailable, ForkServerDied) as e:
                why = str(e)
        with self._lock:
            self.fresh.setdefault(why, []).append(Path(out_path).name)
        return None

    def close(self) -> None:
        super().close()
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)


# Variables a warm process applies before CUDA starts; any other difference from its start-up environment (the
# allocator, the Python path, the FA3 libraries it preloaded) needs a program started for the case.
LATE_VARS = frozenset(
    {"CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"}
    | {CHANNEL_ENV}  # read when the case emits its first record
)


def fits(env: dict[str, str], launch_env: dict[str, str]) -> bool:
    """Can a process started with `launch_env` run a case that asks for `env`?"""
    keys = (set(env) | set(launch_env)) - LATE_VARS
    return all(env.get(k) == launch_env.get(k) for k in keys)


READY_LINE = "REPRO_WARM_READY"  # a warm process printed it once its imports were done


@dataclass
class Warm:
    """A sanitized case process started ahead of its case, waiting on stdin."""

    proc: subprocess.Popen
    memcheck_log: Path  # where its compute-sanitizer writes
    startup_log: Path  # what it printed before its case (import warnings, or why it failed)
    launch_env: dict[str, str]
    ready: bool = False

    def importing(self) -> bool:
        """Still importing (alive and not yet READY_LINE)?"""
        if not self.ready and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                self.ready = READY_LINE in self.startup_log.read_text(errors="replace")
            return not self.ready
        return False

    def start_case(self, target: str, argv: list[str], env: dict[str, str], out_path: Path) -> float:
        """Hand it its case; returns when it was handed (the case's clock starts there)."""
        t0 = time.time()
        Path(out_path).write_bytes(self.startup_log.read_bytes() if self.startup_log.exists() else b"")
        request = {"target": target, "argv": argv, "env": env, "launch_env": self.launch_env, "out": str(out_path)}
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):  # it died while starting: its startup log says why
            pass
        return t0


class WarmPool:
    """Sanitized case processes (compute-sanitizer over `python -m repro.run.executor warm`) started ahead of their
    cases: up to `spares` waiting at any time, at most `budget` started in all (past it, one starts when a case asks),
    and no more than `max_importing` importing at once (every import is seconds of CPU: started all at once they slow
    each other down; measured on the H200, 25 at once took ~10 s each instead of ~4). Each runs one case; close()
    kills the ones never used."""

    def __init__(
        self,
        launch_env: dict[str, str],
        spares: int,
        budget: int,
        preload: tuple[str, ...] = PRELOAD,
        max_importing: int | None = None,
    ):
        self.exe = find_sanitizer()
        self.launch_env = dict(launch_env)
        self.preload = preload
        self.dir = Path(tempfile.mkdtemp(prefix="repro-warm-"))
        self.spares, self.budget = spares, budget
        self.max_importing = max_importing or max(2, (os.cpu_count() or 2) // 2)
        self.spare: list[Warm] = []  # started, not yet given a case
        self.importing: list[Warm] = []  # started, imports not done (given a case or not)
        self.started = 0
        self.lock = threading.Lock()
        self.closed = False
        if self.exe:
            self.top_up()
            threading.Thread(target=self._keep_topped_up, daemon=True).start()

    def _start(self) -> Warm:
        k = self.started
        self.started += 1
        log, startup = self.dir / f"{k}.memcheck.log", self.dir / f"{k}.startup.log"
        cmd = sanitizer_command(self.exe, str(log), kernel_filter="flash")
        cmd += entrypoints.command(entrypoints.EXECUTOR, "warm", ",".join(self.preload))
        with open(startup, "w") as f:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=f,
                stderr=subprocess.STDOUT,
                env=self.launch_env,
                text=True,
                start_new_session=True,
            )
        w = Warm(proc, log, startup, self.launch_env)
        self.importing.append(w)
        return w

    def top_up(self) -> None:
        """Start spares while fewer than `spares` wait, the budget allows and few enough are importing."""
        with self.lock:
            self.importing = [w for w in self.importing if w.importing()]
            while (
                not self.closed
                and len(self.spare) < self.spares
                and self.started < self.budget
                and len(self.importing) < self.max_importing
            ):
                self.spare.append(self._start())

    def _keep_topped_up(self) -> None:
        while not self.closed:
            self.top_up()
            time.sleep(0.1)

    def take(self, env: dict[str, str]) -> Warm | None:
        """A started process for a case with this environment (one done importing first, else the oldest, else one
        started now); None when the environment does not fit (or there is no compute-sanitizer)."""
        if not self.exe or not fits(env, self.launch_env):
            return None
        with self.lock:
            if self.closed:
                return None
            done = [w for w in self.spare if not w.importing()]
            if done or self.spare:
                w = (done or self.spare)[0]
                self.spare.remove(w)
                return w
            return self._start()

    def close(self) -> None:
        with self.lock:
            self.closed = True
            left, self.spare = self.spare, []
        for w in left:
            kill_group(w.proc.pid)
            w.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


def _warm_main(preload: list[str]) -> None:
    """A warm process: import, wait for one case on stdin, run it with the case's environment plus what
    compute-sanitizer added to this process's (its injection), in this process (under the sanitizer)."""
    for module in preload:
        entrypoints.load(module)
    print(READY_LINE, flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        os._exit(0)  # the pool closed before handing it a case
    req = json.loads(line)
    launch = req["launch_env"]
    injected = {k: v for k, v in os.environ.items() if launch.get(k) != v}
    run_child(req["target"], req["argv"], {**req["env"], **injected}, req["out"])


if __name__ == "__main__":  # python -m repro.run.executor warm MODULE,MODULE: a WarmPool process
    if sys.argv[1:2] != ["warm"]:
        sys.exit("usage: python -m repro.run.executor warm MODULE[,MODULE...] (started by WarmPool)")
    _warm_main([m for m in sys.argv[2].split(",") if m] if len(sys.argv) > 2 else [])
