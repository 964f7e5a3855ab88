"""memcheck's own allocator (repro.run.own_alloc, the gate's memcheck:own): its C source compiled here against a
stand-in CUDA runtime (cudaMalloc is malloc) so its bookkeeping runs on the CPU, how the gate builds it, and how a
memcheck:own case is set up."""

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from repro.errors import ConfigError, Unavailable
from repro.run import own_alloc
from repro.run.sanitizer import sanitizer_command
from repro.vllm_integration.gate.modes import GateMode

HEADER = """#ifdef __cplusplus
extern "C" {
#endif
typedef int cudaError_t; typedef void *cudaStream_t;
enum cudaStreamCaptureStatus { cudaStreamCaptureStatusNone = 0, cudaStreamCaptureStatusActive = 1 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeGlobal, cudaStreamCaptureModeThreadLocal, cudaStreamCaptureModeRelaxed };
#define cudaSuccess 0
#define cudaErrorMemoryAllocation 2
cudaError_t cudaStreamIsCapturing(cudaStream_t, enum cudaStreamCaptureStatus *);
cudaError_t cudaGetLastError(void);
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *);
cudaError_t cudaMalloc(void **, unsigned long);
cudaError_t cudaFree(void *);
cudaError_t cudaMemsetAsync(void *, int, unsigned long, cudaStream_t);
int stub_freed(void);
void *stub_last_freed(void);
#ifdef __cplusplus
}
#endif
"""
RUNTIME = """#include <stdlib.h>
#include <string.h>
#include "cuda_runtime_api.h"
static int freed = 0;
static void *last_freed = 0;
cudaError_t cudaStreamIsCapturing(cudaStream_t s, enum cudaStreamCaptureStatus *st) {
    if (s == (cudaStream_t)9) return 906;  /* cudaErrorStreamCaptureImplicit: the legacy stream beside a capture */
    *st = s == (cudaStream_t)7 ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone; return 0; }
cudaError_t cudaGetLastError(void) { return 0; }
cudaError_t cudaThreadExchangeStreamCaptureMode(enum cudaStreamCaptureMode *m) { (void)m; return 0; }
cudaError_t cudaMalloc(void **p, unsigned long n) {  /* 512-byte aligned and zeroed, as cudaMalloc's are */
    if (posix_memalign(p, 512, n)) return 2;
    memset(*p, 0, n);
    return 0;
}
cudaError_t cudaFree(void *p) { freed++; last_freed = p; free(p); return 0; }
void *stub_last_freed(void) { return last_freed; }
int stub_freed(void) { return freed; }
cudaError_t cudaMemsetAsync(void *p, int v, unsigned long n, cudaStream_t s) { (void)s; memset(p, v, n); return 0; }
"""
CAPTURE_STREAM, UNASKABLE = 7, 9  # the stand-in runtime's capturing stream, and one that cannot say


def _compile(d: Path, flags: tuple[str, ...] = ()) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no C++ compiler (g++ or c++) to build the allocator against the stand-in CUDA runtime")
    (d / "cuda_runtime_api.h").write_text(HEADER)
    (d / "runtime.c").write_text(RUNTIME)
    so = d / "own.so"
    cmd = [
        cxx,
        "-shared",
        "-fPIC",
        *flags,
        f"-I{d}",
        "-x",
        "c++",
        str(own_alloc.SOURCE),
        "-x",
        "c",
        str(d / "runtime.c"),
    ]
    subprocess.run([*cmd, "-o", str(so), "-ldl"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(so))
    lib.repro_own_malloc.restype = ctypes.c_void_p
    lib.repro_own_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.repro_own_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.stub_last_freed.restype = ctypes.c_void_p
    return lib


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("own"))


def _nvtx_include() -> Path | None:
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "nvtx3" / "nvToolsExtMem.h").exists():
            return Path(root) / "include"
    return None


def test_the_guarded_build_puts_each_tensor_between_guards_and_frees_the_whole(tmp_path):
    """REPRO_OWN_GUARD: one cudaMalloc holds guard + tensor + guard (each guard the tensor's size, at least 64 KiB,
    512-byte aligned); the pointer handed out is the tensor's, and its free releases the whole allocation. (NVTX
    without compute-sanitizer is a no-op: the registration itself is seen only on a GPU.)"""
    inc = _nvtx_include()
    if inc is None:
        pytest.skip("no NVTX headers (CUDA_HOME/include/nvtx3) to build the guarded allocator against")
    g = _compile(tmp_path, ("-DREPRO_OWN_GUARD", f"-idirafter{inc}"))
    assert g.repro_own_guarded() == 1
    for size, guard in ((100, 65536), (200_000, 200_192)):
        p = g.repro_own_malloc(size, 0, None)
        assert p % 512 == 0
        g.repro_own_free(p, size, 0, None)
        assert g.stub_last_freed() == p - guard  # the allocation's start: the guard before the tensor


def test_the_plain_build_says_it_has_no_guards(lib):
    assert lib.repro_own_guarded() == 0


def _counters(lib) -> dict:
    out = (ctypes.c_uint64 * len(own_alloc.COUNTERS))()
    lib.repro_own_counters(out)
    return dict(zip(own_alloc.COUNTERS, out))


def test_memory_a_capture_allocated_or_freed_is_never_freed_the_rest_is(lib):
    before, start = lib.stub_freed(), _counters(lib)
    eager = [lib.repro_own_malloc(100, 0, None) for _ in range(3)]
    lib.repro_own_capture(1)
    graph = [lib.repro_own_malloc(64, 0, None) for _ in range(5000)]  # the set grows past its first size
    lib.repro_own_free(eager[0], 100, 0, None)  # freed during the capture: a graph may still read it
    lib.repro_own_capture(0)
    on_stream = lib.repro_own_malloc(32, 0, CAPTURE_STREAM)  # its stream captures: the graph's too
    for p in [*graph, on_stream]:
        lib.repro_own_free(p, 64, 0, None)
    lib.repro_own_free(eager[1], 100, 0, None)
    beside = lib.repro_own_malloc(16, 0, UNASKABLE)  # a stream that cannot say whether it captures: kept
    lib.repro_own_free(beside, 16, 0, UNASKABLE)
    c = {k: v - start[k] for k, v in _counters(lib).items()}
    assert lib.stub_freed() - before == 1  # eager[1] only
    assert (c["allocations"], c["frees"], c["kept"], c["failed"], c["graph"]) == (5005, 1, 5003, 0, 5002)
    assert c["bytes_now"] == 3 * 100 + 5000 * 64 + 32 + 16 - 100
    assert c["bytes_peak"] >= c["bytes_now"]
    lib.repro_own_reset_peak()
    assert _counters(lib)["bytes_peak"] == _counters(lib)["bytes_now"]


def _fake_nvcc(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    nvcc = bin_dir / "nvcc"
    nvcc.write_text(
        '#!/bin/sh\n[ "$1" = --version ] && { echo "nvcc ${FAKE_NVCC_VERSION:-13.0}"; exit 0; }\n'
        'while [ "$1" != "-o" ]; do shift; done\necho built >> "$(dirname "$2")/calls"\n: > "$2"\n'
    )
    nvcc.chmod(0o755)
    return bin_dir


def test_the_gate_builds_the_library_once_per_source_text(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_nvcc(tmp_path)}:/usr/bin:/bin")
    first = own_alloc.build(tmp_path / "lib")
    assert first.exists() and first.name.startswith("own_alloc-") and first.suffix == ".so"
    assert own_alloc.build(tmp_path / "lib") == first
    assert (tmp_path / "lib" / "calls").read_text().count("built") == 1


def test_another_compiler_builds_another_library(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{_fake_nvcc(tmp_path)}:/usr/bin:/bin")
    first = own_alloc.build(tmp_path / "lib")
    monkeypatch.setenv("FAKE_NVCC_VERSION", "12.8")  # the same path, another CUDA: as a later process finds it
    own_alloc._nvcc_version.cache_clear()
    other = own_alloc.build(tmp_path / "lib")
    assert other != first and (tmp_path / "lib" / "calls").read_text().count("built") == 2


def test_the_build_folder_is_this_users_alone(tmp_path, monkeypatch):
    """A library in it is loaded into every memcheck:own case process: no other user may put one there."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", f"{_fake_nvcc(tmp_path)}:/usr/bin:/bin")
    monkeypatch.setattr(own_alloc, "_failed", {})  # this process's failures: this test's own
    folder = own_alloc.build_folder()
    assert folder.is_dir() and folder.stat().st_mode & 0o777 == 0o700 and folder.parent.stat().st_mode & 0o077 == 0
    assert own_alloc.build().parent == folder
    folder.chmod(0o777)  # others may enter: refused, the mode cannot run here
    with pytest.raises(Unavailable, match="not this user's alone"):
        own_alloc.build()


def test_without_nvcc_the_mode_is_unavailable_and_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(own_alloc, "find_nvcc", lambda: None)
    with pytest.raises(Unavailable, match="nvcc"):
        own_alloc.build(tmp_path / "lib")


def test_memcheck_own_gates_and_pads_the_others_are_recorded():
    own = GateMode.parse("memcheck:own")
    assert (own.name, own.sanitizer, own.gating) == ("memcheck:own", "own", True)
    assert not GateMode.parse("memcheck").gating and not GateMode.parse("memcheck:async").gating
    cmd = sanitizer_command("compute-sanitizer", "log", kernel_filter="flash", padding=own_alloc.PADDING)
    assert cmd[cmd.index("--padding") + 1] == str(own_alloc.PADDING)
    assert "--padding" not in sanitizer_command("compute-sanitizer", "log")


def test_the_statistics_torch_asks_for_come_from_the_counters(monkeypatch):
    counts = {"allocations": 10, "frees": 4, "kept": 2, "bytes_now": 600, "bytes_peak": 900, "failed": 0}
    monkeypatch.setattr(own_alloc, "counters", lambda: counts)
    s = own_alloc._stats(0)
    assert s["allocated_bytes"]["all"] == {"current": 600, "peak": 900, "allocated": 0, "freed": 0}
    assert s["reserved_bytes"]["all"]["peak"] == 900
    assert s["allocation"]["all"]["current"] == 6 and s["num_device_alloc"] == 10


def test_new_allocations_read_as_leftovers_would_except_off_the_capturing_stream(lib):
    lib.repro_own_fill(own_alloc.DEFAULT_FILL)
    try:
        eager = lib.repro_own_malloc(8, 0, None)
        lib.repro_own_capture(1)
        in_graph = lib.repro_own_malloc(8, 0, CAPTURE_STREAM)
        off_stream = lib.repro_own_malloc(8, 0, None)  # another stream during the capture: a fill there would run now
        unaskable = lib.repro_own_malloc(8, 0, UNASKABLE)
        lib.repro_own_capture(0)
        assert ctypes.string_at(eager, 8) == ctypes.string_at(in_graph, 8) == bytes([own_alloc.DEFAULT_FILL]) * 8
        for p in (off_stream, unaskable):
            assert ctypes.string_at(p, 8) != bytes([own_alloc.DEFAULT_FILL]) * 8
    finally:
        lib.repro_own_fill(-1)


@pytest.mark.parametrize(("text", "byte"), [(None, own_alloc.DEFAULT_FILL), ("none", None), ("0xff", 255), ("0", 0)])
def test_the_fill_byte_from_the_environment(text, byte):
    assert own_alloc.fill_byte(text) == byte


def test_a_fill_that_is_not_a_byte_is_refused():
    with pytest.raises(ValueError, match="a byte"):
        own_alloc.fill_byte("256")


def test_overlapping_captures_keep_memory_until_the_last_one_ends(lib):
    before = lib.stub_freed()
    eager = [lib.repro_own_malloc(8, 0, None) for _ in range(2)]
    lib.repro_own_capture(1)
    lib.repro_own_capture(1)  # a second capture begins before the first ends
    lib.repro_own_capture(0)
    lib.repro_own_free(eager[0], 8, 0, None)  # one capture still underway: kept
    lib.repro_own_capture(0)
    lib.repro_own_free(eager[1], 8, 0, None)  # none: freed
    assert lib.stub_freed() - before == 1


def test_memcheck_own_over_poisoned_entries_needs_both_to_fire():
    """memcheck:own+poison:FILL: memcheck's own allocator with the entries FA3 never writes poisoned, so a stale
    read of one is an access memcheck names; its clean answer rests on the allocator and the poison both firing."""
    from repro.vllm_integration.gate.case import GateCase
    from repro.vllm_integration.gate.coverage import applying
    from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

    mode = GateMode.parse("memcheck:own+poison:int-max")
    assert (mode.sanitizer, mode.poison, mode.gating, mode.label) == (
        "own",
        "int-max",
        True,
        "memcheck-own-poison-int-max",
    )
    case = GateCase(VllmBuild("b", "/nowhere", UNDER_TEST), mode)
    assert {"memcheck:own", "poison:FILL"} <= {n.mode for n in applying(case)}
    assert case.sanitizer_padding == own_alloc.PADDING
    for bad in ("memcheck:own+plain", "memcheck:own+mps:16", "memcheck:own+memcheck:own", "memcheck+poison:int-max"):
        with pytest.raises(ConfigError):
            GateMode.parse(bad)


def test_a_memcheck_own_case_builds_its_allocator_outside_the_runs_logs(tmp_path, monkeypatch):
    """The library is a binary: it is kept in this user's build folder, so a run's logs (what results/ records) hold
    none; the case's environment names it. A build folder others could write to leaves the mode unavailable here
    (its reason given), never an exception out of the case's environment."""
    from repro.contract import request
    from repro.vllm_integration.gate.case import GateCase, case_env
    from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", f"{_fake_nvcc(tmp_path)}:/usr/bin:/bin")
    monkeypatch.setattr(own_alloc, "_failed", {})
    build = VllmBuild("b", str(tmp_path / "prefix"), UNDER_TEST)
    logs = tmp_path / "logs"
    case = GateCase(build, GateMode.parse("memcheck:own"))
    env = case_env(case, [build], logs / "c.audit.json", None, lambda: 132)
    lib = Path(request.read(env).own_alloc)
    assert lib.parent == own_alloc.build_folder() and logs not in lib.parents and lib.exists()
    own_alloc.build_folder().chmod(0o777)
    monkeypatch.setattr(own_alloc, "_failed", {})
    with pytest.raises(Unavailable, match="not this user's alone"):
        case_env(case, [build], logs / "c.audit.json", None, lambda: 132)
