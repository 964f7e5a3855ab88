"""How a vLLM gate case process starts (`gate --launcher fork|spawn`, REPRO_GATE_LAUNCHER): spawned (`python -m
repro.vllm_integration.gate.worker`, a fresh interpreter that imports torch, vLLM and the plugin: ~20 s on the H200) or
forked from its build's forkserver (the harness's one, repro.run.forkserver, as the gate uses it:
repro.vllm_integration.gate.forkserver), which imported them once, without CUDA.

- One forkserver per build, started with the environment the build's cases get less the variables that differ per
  case (LATE_VARS: the device, MPS, CUDA_LAUNCH_BLOCKING, the case's request (REPRO_REQUEST), the case's VLLM_CACHE_ROOT
  and TRITON_CACHE_DIR and channel file; CUDA_VISIBLE_DEVICES is kept as the run has it), all read after import: at CUDA's start, at the
  plugin's registration, at the engine's start.
- A case whose environment differs from its forkserver's in any other variable (one read at import: the Python path,
  PYTORCH_CUDA_ALLOC_CONF, LD_*, TORCH_*, ...), or in a per-case variable that Python code read while the forkserver
  imported (its READY record's read_late), is launched plainly, and its record says why; so is a memcheck case
  (compute-sanitizer runs a program of its own).
- A build whose forkserver refused (an import failed, CUDA started while importing, an import set a per-case
  variable: repro.run.forkserver.prepare), did not get ready in READY_TIMEOUT_S, or died, has its cases launched plainly from
  then on; a case its forkserver was running when it died is killed and launched again plainly. Each such change is
  a note of the build (Launcher.summary, shown in the gate's report), never silent.
- The gate keeps what it had: the case's timeout from its request, the whole process group killed at it, the exit
  status (negative: the signal), the log and the channel file of the case. Between the gate and a forkserver only
  typed records pass (repro.run.forkserver.encode / decode)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from repro.errors import ConfigError, ForkServerDied, ForkUnavailable, Stopped
from repro.vllm_integration.gate import keep as gate_keep
from repro.vllm_integration.gate.forkserver import PRELOAD, TARGET_MAIN, GateForkServer

FORK, SPAWN = "fork", "spawn"
LAUNCHERS = (FORK, SPAWN)
LAUNCHER_ENV = "REPRO_GATE_LAUNCHER"
# fork: the spawned records on every stand-in behaviour (tests/test_vllm_gate_fork.py), and the same verdicts as spawned
# cases on the H200 with --compile none and with inductor, vLLM 0.34.0 and both forms of its self control (the records:
# docs/history.md); every case it cannot fork is spawned, with why
DEFAULT_LAUNCHER = FORK
PRELOAD_ENV = "REPRO_GATE_PRELOAD"  # more modules for the forkserver to import (MODULE[:ATTR],...), e.g. the runner's


def launcher_kind(asked: str | None = None, environ: dict[str, str] | None = None) -> str:
    """`--launcher` when given, else REPRO_GATE_LAUNCHER, else DEFAULT_LAUNCHER."""
    kind = (asked or (os.environ if environ is None else environ).get(LAUNCHER_ENV) or DEFAULT_LAUNCHER).lower()
    if kind not in LAUNCHERS:
        raise ConfigError(f"launcher {kind!r}: use {' or '.join(LAUNCHERS)} (--launcher, {LAUNCHER_ENV})")
    return kind


def preload_list(environ: dict[str, str] | None = None) -> tuple[str, ...]:
    extra = (os.environ if environ is None else environ).get(PRELOAD_ENV, "")
    return PRELOAD + tuple(x.strip() for x in extra.split(",") if x.strip())


class Launcher:
    """The gate run's launcher: which case processes are forked (and from which build's forkserver) and which are
    spawned, with a note for every change from what was asked (summary)."""

    def __init__(
        self, kind: str, log_dir: str | Path, preload: tuple[str, ...] | None = None, keep_s: float | None = None
    ) -> None:
        self.kind, self.keep_s = kind, keep_s
        self.log_dir = Path(log_dir)
        self.preload = preload or preload_list()
        self._servers: dict[object, GateForkServer] = {}
        self._lock = threading.RLock()
        self._stats: dict[str, dict] = {}
        self.closed = False  # close(): the run ended or is stopping

    def _stat(self, label: str) -> dict:
        return self._stats.setdefault(label, {"forked": 0, "spawned": 0, "notes": []})

    def start(self, build, env: dict[str, str]) -> GateForkServer | None:
        """The build's forkserver, started with this case environment (less LATE_VARS) unless it runs already; None
        when the launcher spawns or the build has no package folder to import."""
        if self.kind != FORK:
            return None
        with self._lock:
            if build in self._servers:
                return self._servers[build]
            pkg = build.package_dir
            if pkg is None or not pkg.is_dir():
                self._note(build.label, "no vllm package folder to pre-import: its cases are launched plainly")
                self._servers[build] = None
                return None
            log = self.log_dir / f"forkserver-{build.label}.log"
            identity = gate_keep.build_identity(build) if self.keep_s else ""
            self._servers[build] = server = GateForkServer(build.label, env, log, self.preload, self.keep_s, identity)
            return server

    def server_for(self, build, env: dict[str, str]) -> tuple[GateForkServer | None, str | None]:
        """(the forkserver to fork this case from, None) or (None, why it is launched plainly: None when spawning is
        what was asked)."""
        if self.kind != FORK:
            return None, None
        server = self.start(build, env)
        if server is None:
            return None, "no vllm package folder to pre-import"
        if not server.wait_ready():
            self._note(build.label, f"forkserver {server.failed}: its cases are launched plainly", once=True)
            return None, f"forkserver {server.failed}"
        seen = server.ready.get("vllm")
        if server.kept and build.version and seen and seen != build.version:  # a kept one that imported another vLLM
            self._note(build.label, f"the kept forkserver imported vLLM {seen}, not {build.version}: launched plainly")
            return None, f"kept forkserver's vLLM is {seen}"
        why = server.why_not(env)
        return (None, why) if why else (server, None)

    def launch(self, case, cmd: list[str], env: dict[str, str], log_dir: Path, sanitized: bool, run_process):
        """One case process through `run_process` (repro.run.runner's, as gate_run holds it): forked from its build's
        forkserver where it can be, else spawned as `cmd`. (result, output, what the record's phases get: the
        launcher that started it and, when that is not the one asked for, why)."""
        self.refuse_when_closed()
        server, why = (None, "memcheck runs under compute-sanitizer") if sanitized else self.server_for(case.build, env)
        if server is not None:
            try:
                res, out = run_process(case, cmd, env, log_dir, False, server, (TARGET_MAIN, cmd[3:]))
                self.count(case.build.label, True)
                # what a spawned process would have spent importing, paid once by the build's forkserver
                return res, out, {"launcher": FORK, "preimported_s": server.ready.get("import_s")}
            except ForkServerDied as e:
                why = str(e)
                self._note(case.build.label, f"forkserver died under {case.case_id}: it ran again, launched plainly")
            except ForkUnavailable as e:
                why = str(e)
        self.refuse_when_closed()  # a forkserver closed by a stop is no reason to launch plainly
        res, out = run_process(case, cmd, env, log_dir, sanitized)
        self.count(case.build.label, False, why, case.case_id)
        return res, out, {"launcher": SPAWN, **({"launch_note": why} if why and self.kind == FORK else {})}

    def count(self, label: str, forked: bool, why: str | None = None, case_id: str = "") -> None:
        with self._lock:
            s = self._stat(label)
            s["forked" if forked else "spawned"] += 1
            if why and self.kind == FORK:
                s["notes"].append(f"{case_id}: launched plainly: {why}")

    def _note(self, label: str, text: str, once: bool = False) -> None:
        with self._lock:
            notes = self._stat(label)["notes"]
            if not (once and text in notes):
                notes.append(text)

    def summary(self) -> dict[str, dict]:
        """Per build: the launcher asked for, the case processes forked and spawned, the forkserver's import time
        and facts (threads, what the imports set), and every note."""
        out = {}
        for build, server in self._servers.items():
            s = self._stat(build.label)
            if server is not None and server.ready:
                r = server.ready
                s["forkserver"] = {
                    k: r.get(k) for k in ("pid", "import_s", "native_threads", "python_threads", "driver")
                }
                s["forkserver"]["env_set"] = sorted(r.get("env_set") or {})
                s["forkserver"]["read_late"] = r.get("read_late") or []
                if r.get("read_late"):
                    self._note(
                        build.label,
                        f"Python code read {', '.join(r['read_late'])} while the forkserver imported: a case that sets "
                        "another value is launched plainly",
                        once=True,
                    )
                s["forkserver"]["ready_after_s"] = round((server.ready_at or server.t0) - server.t0, 1)
                if server.keep_s:  # gate_keep: kept for later runs, or one an earlier run left
                    s["forkserver"]["kept"] = {
                        "reused": server.kept,
                        "served": r.get("served"),
                        "idle_s": server.keep_s,
                    }
            if (
                server is not None
                and server.failed
                and not server.closing
                and not any("forkserver" in n for n in s["notes"])
            ):
                s["notes"].append(f"forkserver {server.failed}")
        for label, s in self._stats.items():
            out[label] = {"launcher": self.kind, **s}
        return out

    def close(self) -> None:
        """No case launches any more (Stopped), and each forkserver is closed (its children killed)."""
        self.closed = True
        for server in [s for s in self._servers.values() if s is not None]:
            server.close()

    def refuse_when_closed(self) -> None:
        if self.closed:
            raise Stopped("the gate run is stopping: no case process starts")
