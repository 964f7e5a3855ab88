"""What the vLLM gate keeps between its cases and its runs, per build: vLLM's own caches (the model-info records its
model registry would otherwise make in a subprocess that imports vLLM again, and the torch.compile artifacts) and the
build's reference run. Everything is keyed by the build's fingerprint, so two builds never share a cache and a
changed build (any Python file, any compiled extension) starts a cold one.

Layout: ROOT/vllm-gate/<fingerprint>/
  build.json          what the fingerprint covered (label, version, prefix, file counts, torch), for a person
  used                when a gate run last used the folder (GateCache.prune removes the ones unused longest)
  vllm-cache/         the build's VLLM_CACHE_ROOT, written in place by one case (vllm-cache.claim holds its process
                      id; cases running meanwhile get an empty folder of their own) and used in place by later cases
                      once that case got past torch.compile (vllm-cache.complete; its probe counted captures)
  triton-cache/       the build's Triton kernels (its cases' TRITON_CACHE_DIR, shared: entries keyed by content)
  references/<key>.json  a clean reference run: RESULT record and verdict; <key> also covers the SM configuration, the
                      GPU and the gate's own model, prompts and weights code (repro.vllm_integration.gate.worker, plugin)

ROOT is REPRO_CACHE_DIR, else ~/.cache/repro. vLLM checks what it loads itself: model-info records carry the hash of
their model file, AOT artifacts are loaded only when the traced sources are unchanged, anything else compiles again."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from repro import entrypoints
from repro.case.spec import CaseResult
from repro.contract.channel import path_for, write_record
from repro.contract.tags import RESULT_TAG
from repro.files import write_whole
from repro.report.environment import gpu_facts
from repro.run.runner import case_logs
from repro.vllm_integration.gate.case import WEIGHTS_ENV, GateCase
from repro.vllm_integration.gate.methods import DEFAULT_METHOD
from repro.vllm_integration.gate.worker import COMPILES, DEFAULT_COMPILE
from repro.vllm_integration.releases.builds import VllmBuild

CACHE_ENV = "REPRO_CACHE_DIR"
VLLM_CACHE = "vllm-cache"
COMPLETE, CLAIM = f"{VLLM_CACHE}.complete", f"{VLLM_CACHE}.claim"  # markers beside it
TRITON_CACHE = "triton-cache"  # the build's Triton kernels, beside its vLLM cache (GateCache.triton_dir)
TRITON_ENV = "TRITON_CACHE_DIR"  # vLLM keeps a value given (compilation/compiler_interface.initialize_inductor_cache)
WARM, WRITER, COLD = "warm", "cold, writer", "cold"  # what a case's VLLM_CACHE_ROOT is (case_cache)
PRIVATE, KEPT = "private", "reference kept"  # the old path (no cache); a reference not run, its kept record used
USED = "used"
KEEP_BUILDS, MAX_AGE_DAYS = 12, 30.0  # prune's bounds: the build folders kept, the days one is kept unused
MIN_IDLE_S = 6 * 3600  # a folder used more recently is never removed (another gate run may be using it in place)
_FOLDER = re.compile(r"[0-9a-f]{20}")
_EDGE = 1 << 20  # bytes read from each end of a compiled extension
# The gate's model, prompts and weights: a reference depends on their text. Each module's text is hashed under a
# label, the file's name when the key began, not under its place: a module's folder is not what a reference depends on
# (its text is: an edit, an import rewritten by a move included, makes the kept references cold).
_GATE_SOURCES = entrypoints.GATE_SOURCES


def default_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "repro")


def _torch_version() -> str:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def package_fingerprint(pkg: Path, torch_version: str | None = None) -> tuple[str, dict]:
    """sha256 over a vllm package folder: the path and content of every Python file, and the path, size and first and
    last MiB of every compiled extension (a different build of a .so differs there: its build id and symbol tables);
    plus the torch release and Python version the cases run with. (hex digest, what it covered)."""
    h = hashlib.sha256()
    py = so = 0
    for p in sorted(pkg.rglob("*")):
        if not p.is_file() or "__pycache__" in p.parts:
            continue
        rel = p.relative_to(pkg).as_posix()
        if p.suffix == ".py":
            h.update(b"py\0" + rel.encode() + b"\0" + p.read_bytes() + b"\0")
            py += 1
        elif p.suffix == ".so" or ".so." in p.name:
            size = p.stat().st_size
            with p.open("rb") as f:
                head = f.read(_EDGE)
                f.seek(max(0, size - _EDGE))
                tail = f.read(_EDGE)
            h.update(b"so\0" + rel.encode() + b"\0" + str(size).encode() + b"\0" + head + tail + b"\0")
            so += 1
    torch, python = torch_version or _torch_version(), f"{sys.version_info.major}.{sys.version_info.minor}"
    h.update(f"torch={torch}\0python={python}".encode())
    return h.hexdigest(), {"python_files": py, "compiled_extensions": so, "torch": torch, "python": python}


@functools.cache
def gate_code_fingerprint() -> str:
    """The gate's model configuration, prompts and weights code: a cached reference is for one version of them."""
    h = hashlib.sha256()
    for label, module in _GATE_SOURCES.items():
        h.update(label.encode() + b"\0" + Path(entrypoints.source(module)).read_bytes())
    h.update(f"weights={os.environ.get(WEIGHTS_ENV, '')}".encode())  # chosen in the gate's environment
    return h.hexdigest()[:16]


@dataclass
class GateCache:
    """One cache root. Each build's fingerprint is computed once per GateCache (a build does not change under a
    running gate; a new run fingerprints again)."""

    root: Path

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self._fp: dict[str, str] = {}
        self._lock = threading.Lock()  # the gate's case threads ask for fingerprints at once

    def fingerprint(self, build: VllmBuild) -> str:
        key = f"{build.prefix or '<installed>'}+{build.torch_prefix or ''}"
        with self._lock:
            return self._fp.get(key) or self._fingerprint(build, key)

    def _fingerprint(self, build: VllmBuild, key: str) -> str:
        pkg = build.package_dir
        if pkg is None or not pkg.is_dir():
            raise FileNotFoundError(f"vLLM build {build.label}: no vllm package folder to fingerprint")
        digest, covered = package_fingerprint(pkg, build.torch_version)
        self._fp[key] = digest[:20]
        d = self.build_dir_for(digest[:20])
        d.mkdir(parents=True, exist_ok=True)
        info = d / "build.json"
        if not info.exists():
            _write_json(info, {**build.to_dict(), **covered, "fingerprint": digest, "created": _now()})
        (d / USED).write_text(_now())  # once per run and build (the fingerprint is computed once per GateCache)
        return self._fp[key]

    def prune(self, keep: int = KEEP_BUILDS, max_age_days: float = MAX_AGE_DAYS, protect=()) -> list[Path]:
        """Remove the build folders not used for max_age_days and those past the `keep` most recently used (this
        run's builds, `protect`, count among them and are never removed); never a folder used in the last MIN_IDLE_S
        nor one whose writer's claim a live process holds. Returns what was removed."""
        base = self.root / "vllm-gate"
        mine = set()
        for b in protect:
            try:
                mine.add(self.fingerprint(b))
            except FileNotFoundError:  # no package folder: nothing of it is cached
                continue
        if not base.is_dir():
            return []
        now, folders = time.time(), []
        for d in base.iterdir():
            held = any(_held(d / GateCache._names(c)[2]) for c in COMPILES)
            if d.is_dir() and _FOLDER.fullmatch(d.name) and d.name not in mine and not held:
                folders.append((_last_used(d), d))
        removed = []
        for i, (used, d) in enumerate(sorted(folders, reverse=True)):
            old = now - used > max_age_days * 86400
            if (old or i >= max(0, keep - len(mine))) and now - used > MIN_IDLE_S:
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
        return removed

    def build_dir_for(self, fingerprint: str) -> Path:
        return self.root / "vllm-gate" / fingerprint

    def build_dir(self, build: VllmBuild) -> Path:
        return self.build_dir_for(self.fingerprint(build))

    # --- vLLM's own caches ----------------------------------------------------------------------------------------
    # vLLM's compiled artifacts name their folder by absolute path (the AOT record points at its artifact files), so
    # a cache cannot be copied or moved: the build's one folder is written in place by one case (the writer) and
    # used in place by every later case once the writer has finished compiling (the `complete` marker).

    @staticmethod
    def _names(compile: str) -> tuple[str, str, str]:
        """The build's vLLM cache folder and its markers for one compile setting (gate.worker.COMPILES): a run without
        torch.compile leaves no inductor artifacts, so it never completes the inductor folder (nor uses it)."""
        if compile == DEFAULT_COMPILE:
            return VLLM_CACHE, COMPLETE, CLAIM
        folder = f"{VLLM_CACHE}-{compile}"
        return folder, f"{folder}.complete", f"{folder}.claim"

    def case_cache(
        self, build: VllmBuild, private: Path, may_write: bool = True, compile: str = DEFAULT_COMPILE
    ) -> tuple[Path, str]:
        """The VLLM_CACHE_ROOT for a case of `build` and what it is: (the build's folder, WARM) once complete;
        (the build's folder, WRITER) for the first case that may write (a speculative case: it compiles) while no
        other case holds the claim; else (`private`, an empty folder of its own, COLD). A WRITER must call
        release(). One folder per compile setting."""
        d = self.build_dir(build)
        shared, done, claim = (d / n for n in self._names(compile))
        with self._lock:
            if done.exists() and shared.is_dir():
                return shared, WARM
            if may_write and _claim(claim):
                shutil.rmtree(shared, ignore_errors=True)  # what a writer that never finished left
                shared.mkdir(parents=True)
                return shared, WRITER
        shutil.rmtree(private, ignore_errors=True)
        private.mkdir(parents=True)
        return private, COLD

    def is_warm(self, build: VllmBuild, compile: str = DEFAULT_COMPILE) -> bool:
        """Is the build's vLLM cache for this compile setting complete (a case started now uses it: WARM)?"""
        d = self.build_dir(build)
        shared, done, _claim_name = (d / n for n in self._names(compile))
        return done.exists() and shared.is_dir()

    def release(self, build: VllmBuild, compiled: bool, compile: str = DEFAULT_COMPILE) -> None:
        """The writer's case ended: its folder is the build's cache when it got past torch.compile (`compiled`: its
        probe counted captures), else it is removed; the claim is given up either way."""
        d = self.build_dir(build)
        folder, done, claim = self._names(compile)
        with self._lock:
            if compiled:
                (d / done).write_text(_now())
            else:
                shutil.rmtree(d / folder, ignore_errors=True)
            (d / claim).unlink(missing_ok=True)

    def triton_dir(self, build: VllmBuild) -> Path:
        """The build's Triton kernel cache (TRITON_CACHE_DIR of its cases): vLLM's JIT warmup and inductor's kernels.
        Shared by concurrent cases (Triton names each entry by its own content key and writes it by rename), so a
        warm case compiles none of them. Without it vLLM points Triton into the compiling case's folder, and a case
        that loads its compiled artifacts instead into ~/.triton: outside the cache, and cold there the first time."""
        d = self.build_dir(build) / TRITON_CACHE
        d.mkdir(parents=True, exist_ok=True)
        return d

    # --- references -----------------------------------------------------------------------------------------------

    def reference_path(self, build: VllmBuild, sm_label: str, gpu: str) -> Path:
        key = hashlib.sha256(f"{sm_label}\0{gpu}\0{gate_code_fingerprint()}".encode()).hexdigest()[:16]
        return self.build_dir(build) / "references" / f"{key}.json"

    def load_reference(self, build: VllmBuild, sm_label: str, gpu: str) -> dict | None:
        """A stored reference ({"result": RESULT record, "case": CaseResult dict, "stored": when, ..., "path": the
        file it was read from}) or None."""
        p = self.reference_path(build, sm_label, gpu)
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            return None
        return {**d, "path": str(p)} if isinstance(d, dict) and d.get("result", {}).get("tokens") else None

    def store_reference(
        self, build: VllmBuild, sm_label: str, gpu: str, result: dict, case: dict, records: str = ""
    ) -> Path:
        """Keep a validated reference: its RESULT record, its CaseResult, and its process's channel records whole
        (`records`: what a run that uses it writes into its own logs, so the run's record holds what it judged from)."""
        p = self.reference_path(build, sm_label, gpu)
        p.parent.mkdir(parents=True, exist_ok=True)
        _write_json(
            p,
            {
                "result": result,
                "case": case,
                "records": records,
                "sm": sm_label,
                "gpu": gpu,
                "gate_code": gate_code_fingerprint(),
                "stored": _now(),
            },
        )
        return p

    # --- what each case took (the scheduler's order: gate.order) ----------------------------------------------------

    def costs_path(self, gpu: str) -> Path:
        key = hashlib.sha256(gpu.encode()).hexdigest()[:16]
        return self.root / "vllm-gate" / "costs" / f"{key}.json"

    def load_costs(self, gpu: str) -> dict[str, float]:
        """{case id: slot seconds} this GPU's runs from this cache folder measured ({} where none did)."""
        try:
            d = json.loads(self.costs_path(gpu).read_text())
        except (OSError, ValueError):
            return {}
        got = d.get("costs") if isinstance(d, dict) else None
        return {k: float(v) for k, v in (got or {}).items() if isinstance(v, (int, float))}

    def store_costs(self, gpu: str, costs: dict[str, float]) -> None:
        """The run's measured seconds per case over those kept (a case this run did not run keeps its last)."""
        if costs:
            merged = {**self.load_costs(gpu), **{k: round(v, 1) for k, v in costs.items()}}
            self.costs_path(gpu).parent.mkdir(parents=True, exist_ok=True)
            _write_json(self.costs_path(gpu), {"gpu": gpu, "costs": merged, "stored": _now()})


def _claim(path: Path) -> bool:
    """Take the writer's claim (a file made with O_EXCL, holding this process's id); a claim whose process is gone is
    taken over. True when this process now holds it."""
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                pid = int(path.read_text().strip() or 0)
                os.kill(pid, 0)
                return False  # held by a live process (this one's other case, or another gate run)
            except (OSError, ValueError):
                path.unlink(missing_ok=True)  # its process is gone: take it over
                continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _held(claim: Path) -> bool:
    """Is the writer's claim held by a live process?"""
    try:
        pid = int(claim.read_text().strip() or 0)
        if pid > 0:
            os.kill(pid, 0)
            return True
    except (OSError, ValueError):
        pass
    return False


def _last_used(d: Path) -> float:
    for marker in (d / USED, d / "build.json", d):
        try:
            return marker.stat().st_mtime
        except OSError:
            continue
    return 0.0


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _write_json(path: Path, obj: dict) -> None:
    """Written whole or not at all (repro.files: a temporary file beside it, then one rename)."""
    write_whole(path, json.dumps(obj, indent=1, default=str))


def ref_key(case: GateCase) -> str:
    """What a kept reference is for, besides its build, GPU and the gate's code: backend, SM configuration and the
    speculative method (EAGLE's key stays as kept before methods)."""
    key = f"{case.backend}/{case.mode.sm.label}"
    return key if case.method == DEFAULT_METHOD else f"{key}/{case.method}"


def gpu_identity() -> str:
    """The GPU a kept reference is for: its name and SM count (probed in a child; 'no GPU' without one)."""
    facts = gpu_facts()
    return f"{facts.get('gpu')} {facts.get('sms')} SMs" if facts.get("gpu") else "no GPU"


def kept_reference(case: GateCase, kept: dict) -> CaseResult:
    """The reference case's record from the cache (GateCache.load_reference): the stored clean result, its history
    saying where it came from."""
    return CaseResult(**kept["case"]).revised(
        "reference cache",
        f"reference run of {kept.get('stored')} kept for this build ({kept['path']})",
        phases={"wall": 0.0, "vllm_cache": KEPT},
    )


KEPT_LINE = "reference kept:"  # the first words of a kept reference's out.log (keep_in_logs)


def keep_in_logs(log_dir: str | Path, case: GateCase, kept: dict) -> None:
    """A kept reference's record in the run's logs, as its process left it: a line of output that says where it came
    from, and the channel records it wrote (a reference kept before they were stored: its RESULT record alone), so
    that the run's record holds everything its verdicts were judged from."""
    out_log = case_logs(log_dir, case.case_id)[0]
    out_log.parent.mkdir(parents=True, exist_ok=True)
    out_log.write_text(f"{KEPT_LINE} the run of {kept.get('stored')} for this build, SM configuration and GPU\n")
    channel = path_for(out_log)
    channel.unlink(missing_ok=True)
    if kept.get("records"):
        channel.write_text(kept["records"])
    else:
        write_record(channel, RESULT_TAG, kept["result"])


def forkserver_ready(launches: dict | None) -> float | None:
    """How long a run's slowest forkserver took to be ready from its start, from its record's `launches` (0: kept from
    an earlier run; the run's GPU probes ran beside it); None: spawned (no forkserver)."""
    waits = [s["forkserver"]["ready_after_s"] for s in (launches or {}).values() if "forkserver" in s]
    return max(waits) if waits else None
