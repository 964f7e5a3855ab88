"""memcheck's own allocator (the vLLM gate's `memcheck:own` mode): one cudaMalloc per tensor, so
compute-sanitizer memcheck knows every tensor's bounds. With torch's caching allocator an over-read past a tensor
lands in the rest of its segment, which memcheck counts as valid (0.25.1 did not fault under memcheck, 2 of 2 runs);
cudaMallocAsync keeps each tensor apart, but a graph's allocations are unmapped until it launches, and vLLM's Triton
launchers refuse them (results/h200-compile-none, h200-memcheck-nostatic).

- `build(folder)`: compiles own_alloc.c (beside this file) with nvcc into folder, once per source text; Unavailable
  when there is no nvcc.
- `install(path)`: in the case process, before anything starts CUDA: torch's allocator becomes this one
  (CUDAPluggableAllocator), graph captures tell it when they run (memory a capture allocates, or frees, stays the
  graph's and is never freed), and the statistics torch asks an allocator for come from its counters (the
  pluggable allocator keeps none: vLLM's memory accounting would raise).
- `counters()`: allocations, frees, kept for graphs, bytes now and at peak, failed allocations.
- fill: new allocations are filled with DEFAULT_FILL (REPRO_OWN_ALLOC_FILL in the gate's environment), as reused
  memory would hold leftovers (a fresh cudaMalloc reads as zeros, which hides a kernel reading what nobody wrote).
- PADDING: bytes of compute-sanitizer's guard after every allocation (`--padding`), so a read past one tensor never
  lands in the next one."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import threading
from pathlib import Path

from repro.errors import Unavailable
from repro.run.kept import private_dir

SOURCE = Path(__file__).with_name("own_alloc.c")
MALLOC, FREE = "repro_own_malloc", "repro_own_free"
PADDING = 65536
GUARD_ENV = "REPRO_OWN_ALLOC_GUARD"  # "1": guards as large as each tensor, through NVTX (guard_wanted)
FILL_ENV = "REPRO_OWN_ALLOC_FILL"  # the byte new allocations are filled with (0-255; "none": not filled)
DEFAULT_FILL = 0x7F  # ints 0x7F7F7F7F, floats 3.4e38: what an index or a count read from unwritten memory becomes
COUNTERS = ("allocations", "frees", "kept", "bytes_now", "bytes_peak", "failed", "graph")
BUILD_TIMEOUT_S = 120
_lib: ctypes.CDLL | None = None
_building = threading.Lock()
_failed: dict[Path, str] = {}  # folder -> why its build failed, once per run


def find_nvcc() -> str | None:
    path = shutil.which("nvcc")
    if path:
        return path
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and os.path.exists(os.path.join(root, "bin", "nvcc")):
            return os.path.join(root, "bin", "nvcc")
    return None


def guard_wanted(environ: dict[str, str] | None = None) -> bool:
    """GUARD_ENV=1: the allocator built with REPRO_OWN_GUARD (guards as large as each tensor, registered with
    compute-sanitizer through NVTX); unverified on a GPU so far, so not the default."""
    return (os.environ if environ is None else environ).get(GUARD_ENV, "") == "1"


def build_folder() -> Path:
    """Where the allocator is built and kept: this user's own folder (repro.run.kept.private_dir: no other user can
    put a library there for a case process to load), one library per source text, compiler and flags (their hash in
    the name); never a run's logs (a record holds no binary)."""
    return private_dir("own-alloc")


def build(folder: str | Path | None = None, guard: bool = False) -> Path:
    """The allocator library for this source text (and guard), built into folder (default build_folder()) unless it
    is there already (one build at a time in this process: the gate's case threads ask together)."""
    with _building:
        key = str(folder)
        if key in _failed:  # every case of the run would wait for the same failure again
            raise Unavailable(_failed[key])
        try:
            return _build(Path(folder) if folder is not None else build_folder(), guard)
        except Unavailable as e:
            _failed[key] = str(e)
            raise
        except OSError as e:  # no compiler to run, no folder to write (or not this user's alone): cannot run here
            _failed[key] = f"memcheck:own could not build its allocator: {type(e).__name__}: {e}"
            raise Unavailable(_failed[key]) from e


@functools.cache
def _nvcc_version(nvcc: str) -> str:
    """What `nvcc --version` says, asked once per compiler in this process (every memcheck:own case asks for the
    library)."""
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(folder: Path, guard: bool) -> Path:
    nvcc = find_nvcc()
    if nvcc is None:
        raise Unavailable("memcheck:own builds its allocator with nvcc (CUDA's compiler): none on PATH or in CUDA_HOME")
    flags = ["-shared", "-O2", "-Xcompiler", "-fPIC", *(["-DREPRO_OWN_GUARD"] if guard else [])]
    libs = ["-lcudart", *(["-ldl"] if guard else [])]
    # the compiler's own version is in the library's name: another CUDA's build is another library
    key = hashlib.sha256(SOURCE.read_bytes() + "\0".join([str(nvcc), _nvcc_version(nvcc), *flags, *libs]).encode())
    lib = Path(folder) / f"own_alloc{'-guard' if guard else ''}-{key.hexdigest()[:12]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    tmp = lib.with_name(f"{lib.name}.{os.getpid()}.{threading.get_ident()}")
    cmd = [nvcc, *flags, "-x", "cu", str(SOURCE), "-o", str(tmp), *libs]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise Unavailable(f"memcheck:own: nvcc did not build its allocator in {BUILD_TIMEOUT_S} s") from e
    if done.returncode != 0 or not tmp.exists():
        raise Unavailable(f"memcheck:own: nvcc failed to build its allocator: {(done.stderr or done.stdout)[-300:]}")
    os.replace(tmp, lib)  # concurrent builders: one complete file wins
    return lib


def counters() -> dict[str, int]:
    if _lib is None:
        return {}
    out = (ctypes.c_uint64 * len(COUNTERS))()
    _lib.repro_own_counters(out)
    return dict(zip(COUNTERS, (int(v) for v in out)))


def _stats(device=None) -> dict:
    """What torch's caching allocator reports (torch._C._cuda_memoryStats, nested), from this allocator's counters."""
    c = counters()
    live = c.get("allocations", 0) - c.get("frees", 0)

    def stat(cur, peak, allocated=0, freed=0):
        return {"current": cur, "peak": peak, "allocated": allocated, "freed": freed}

    def pools(s):
        return {"all": s, "large_pool": s, "small_pool": stat(0, 0)}

    size = pools(stat(c.get("bytes_now", 0), c.get("bytes_peak", 0)))
    count = pools(stat(live, live, c.get("allocations", 0), c.get("frees", 0)))
    return {
        **{k: size for k in ("allocated_bytes", "reserved_bytes", "active_bytes", "requested_bytes")},
        **{k: count for k in ("allocation", "segment", "active")},
        "inactive_split": pools(stat(0, 0)),
        "inactive_split_bytes": pools(stat(0, 0)),
        "oversize_allocations": stat(0, 0),
        "oversize_segments": stat(0, 0),
        "num_alloc_retries": 0,
        "num_ooms": c.get("failed", 0),
        "num_sync_all_streams": 0,
        "num_device_alloc": c.get("allocations", 0),
        "num_device_free": c.get("frees", 0),
        "max_split_size": -1,
    }


def install(path: str | Path, fill: int | None) -> dict:
    """Make the library at path torch's CUDA allocator in this process (before CUDA starts: torch refuses to swap an
    allocator it initialised), its new allocations filled with the byte `fill` (None: not filled; the gate reads
    FILL_ENV with fill_byte into the case's request). Returns the record the case announces."""
    global _lib
    import torch  # in the case process only: the gate that builds the library never needs torch

    path = str(path)
    lib = ctypes.CDLL(path)
    lib.repro_own_capture.argtypes = [ctypes.c_int]
    lib.repro_own_fill.argtypes = [ctypes.c_int]
    lib.repro_own_fill(-1 if fill is None else fill)
    torch.cuda.memory.change_current_allocator(torch.cuda.memory.CUDAPluggableAllocator(path, MALLOC, FREE))
    _lib = lib
    graph = torch.cuda.CUDAGraph
    begin, end = graph.capture_begin, graph.capture_end

    def capture_begin(self, *args, **kwargs):
        lib.repro_own_capture(1)
        try:
            return begin(self, *args, **kwargs)
        except BaseException:
            lib.repro_own_capture(0)
            raise

    def capture_end(self, *args, **kwargs):
        try:
            return end(self, *args, **kwargs)
        finally:
            lib.repro_own_capture(0)

    graph.capture_begin, graph.capture_end = capture_begin, capture_end
    torch._C._cuda_memoryStats = _stats
    torch._C._cuda_resetPeakMemoryStats = lambda device=None: lib.repro_own_reset_peak()
    torch._C._cuda_resetAccumulatedMemoryStats = lambda device=None: None
    for name, fn in (
        ("_accelerator_getDeviceStats", _stats),
        ("_accelerator_resetPeakStats", lambda device=None: lib.repro_own_reset_peak()),
        ("_accelerator_resetAccumulatedStats", lambda device=None: None),
    ):
        if hasattr(torch._C, name):
            setattr(torch._C, name, fn)
    guarded = bool(lib.repro_own_guarded())
    return {
        "installed": "own_allocator",
        "library": Path(path).name,
        "padding": PADDING,
        "fill": fill,
        "guard": guarded,
    }


def fill_byte(text: str | None) -> int | None:
    """FILL_ENV's value: unset is DEFAULT_FILL, "none" no fill, else a byte (decimal or 0x..)."""
    if text is None or not text.strip():
        return DEFAULT_FILL
    if text.strip().lower() == "none":
        return None
    value = int(text, 0)
    if not 0 <= value <= 255:
        raise ValueError(f"{FILL_ENV}={text}: a byte (0-255) or none")
    return value
