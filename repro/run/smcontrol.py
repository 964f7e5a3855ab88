"""SM restriction the machine provides: an MPS daemon owned by the run, MIG slices through NVML, green contexts."""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from repro import exit_codes
from repro.errors import Unavailable
from repro.exit_codes import Exit


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    uuid: str
    sms: int | None
    mig_mode: bool
    slices: tuple[MigSlice, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class MigSlice:
    gpu_index: int
    index: int
    uuid: str
    profile: str
    sms: int | None
    memory_mib: int

    def to_dict(self) -> dict:
        return asdict(self)


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)


def enumerate_gpus(nvml: Any = None) -> list[GpuInfo]:
    """GPUs and their MIG slices through NVML (module pynvml from nvidia-ml-py). `nvml` may be a stand-in for tests.
    Raises Unavailable when NVML is missing or finds no driver."""
    if nvml is None:
        try:
            import pynvml as nvml  # type: ignore[no-redef]  # NVML only when asked: nvidia-ml-py is optional
        except ImportError as e:
            raise Unavailable("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from e
    try:
        nvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
        raise Unavailable(f"NVML unavailable: {e}") from e
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            h = nvml.nvmlDeviceGetHandleByIndex(i)
            try:
                cur, _pending = nvml.nvmlDeviceGetMigMode(h)
            except Exception:
                cur = 0
            slices = []
            if cur:
                for j in range(nvml.nvmlDeviceGetMaxMigDeviceCount(h)):
                    try:
                        m = nvml.nvmlDeviceGetMigDeviceHandleByIndex(h, j)
                    except Exception:
                        continue
                    attrs = nvml.nvmlDeviceGetAttributes(m)
                    mem = nvml.nvmlDeviceGetMemoryInfo(m).total // (1 << 20)
                    name = _s(nvml.nvmlDeviceGetName(m))
                    profile = name.split("MIG ")[-1] if "MIG " in name else name
                    slices.append(
                        MigSlice(i, j, _s(nvml.nvmlDeviceGetUUID(m)), profile, int(attrs.multiprocessorCount), int(mem))
                    )
            gpus.append(
                GpuInfo(i, _s(nvml.nvmlDeviceGetName(h)), _s(nvml.nvmlDeviceGetUUID(h)), None, bool(cur), tuple(slices))
            )
        return gpus
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def mps_granted_sms(pct: int, total: int) -> int:
    """SMs an MPS client gets for an active-thread percentage: total * pct / 100 rounded down to an even count
    (measured on a 132-SM H200: 12% -> 14, 13% -> 16, 25% -> 32, 50% -> 66)."""
    return max(2, (total * pct // 100) // 2 * 2)


def sm_refusal(kind: str, sms: int | None, total: int) -> str | None:
    """Why an SM configuration cannot be had on a GPU of `total` SMs (None: it can): more SMs than the GPU has, or
    under MPS a count its active-thread percentages never grant (they grant even counts: mps_granted_sms), which the
    case process would then report as another count."""
    if not sms:
        return None
    if sms > total:
        return f"{kind}:{sms}: impossible SM count, this GPU has {total}"
    if kind == "mps":
        granted = mps_granted_sms(mps_percentage(sms, total), total)
        if granted != sms:
            lower = max(
                (n for n in range(2, sms) if mps_granted_sms(mps_percentage(n, total), total) == n), default=None
            )
            near = " or ".join(f"mps:{n}" for n in (lower, granted) if n)
            return f"mps:{sms}: MPS gives this {total}-SM GPU no {sms} SMs (the nearest percentage gives {granted}): use {near}"
    return None


def mps_percentage(sms: int, total: int) -> int:
    """Smallest active-thread percentage that grants at least `sms` SMs (the worker verifies the exact count)."""
    if not 0 < sms <= total:
        raise Unavailable(f"cannot give {sms} SMs on a {total}-SM GPU")
    for pct in range(1, 101):
        if mps_granted_sms(pct, total) >= sms:
            return pct
    return 100


# SMs of GPU 0 through the CUDA driver alone, in a child of its own (the caller never initializes CUDA): no torch
# import, so the probe takes a fraction of a second instead of the ~4 s `import torch` takes on an H200.
_SM_PROBE = """
import ctypes, sys
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    sys.exit(f"no CUDA driver: {e}")
def check(rc, what):
    if rc:
        msg = ctypes.c_char_p()
        cu.cuGetErrorString(rc, ctypes.byref(msg))
        sys.exit(f"{what}: {(msg.value or b'error %d' % rc).decode()}")
check(cu.cuInit(0), "cuInit")
dev, n = ctypes.c_int(), ctypes.c_int()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cu.cuDeviceGetAttribute(ctypes.byref(n), 16, dev), "cuDeviceGetAttribute")  # MULTIPROCESSOR_COUNT
print(n.value)
"""


def device_sm_count() -> int:
    """SMs of GPU 0 as an unrestricted CUDA process with this environment sees them (probed once per CUDA_*
    environment, in a child: the caller never touches CUDA)."""
    return _sm_count(tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("CUDA_"))))


@functools.lru_cache(maxsize=8)
def _sm_count(cuda_env: tuple[tuple[str, str], ...]) -> int:
    r = subprocess.run([sys.executable, "-c", _SM_PROBE], capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        err = r.stderr.strip().splitlines()
        raise Unavailable(f"no CUDA device: {err[-1] if err else r.returncode}")
    return int(r.stdout.strip().splitlines()[-1])


class MpsDaemon:
    """An MPS control daemon owned by this run: started in private pipe/log folders, stopped on exit or Ctrl-C. The
    folders exist from start() until stop() (or a start that failed): constructing one writes nothing."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.env: dict[str, str] = {}  # the pipe and log folders, once started
        self.running = False
        self._old_int = None

    def start(self) -> MpsDaemon:
        exe = shutil.which("nvidia-cuda-mps-control")
        if not exe:
            raise Unavailable("nvidia-cuda-mps-control not found (MPS needs the NVIDIA driver utilities)")
        self.dir = tempfile.mkdtemp(prefix="repro-mps-")
        self.env = {
            "CUDA_MPS_PIPE_DIRECTORY": os.path.join(self.dir, "pipe"),
            "CUDA_MPS_LOG_DIRECTORY": os.path.join(self.dir, "log"),
        }
        try:
            for d in self.env.values():
                os.makedirs(d, exist_ok=True)
            env = {**os.environ, **self.env}
            r = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True, timeout=30)
            if r.returncode != 0:
                raise Unavailable(f"MPS daemon did not start: {r.stderr.strip() or r.returncode}")
        except BaseException:
            self._remove_dir()
            raise
        self.running = True
        self._old_int = signal.getsignal(signal.SIGINT)

        def on_int(signum, frame):  # stop the daemon, then behave as Ctrl-C normally does
            self.stop()
            raise KeyboardInterrupt

        with contextlib.suppress(ValueError):  # not in the main thread
            signal.signal(signal.SIGINT, on_int)
        return self

    def command(self, line: str, timeout_s: float = 10) -> str:
        """One command to the control daemon (get_server_list, get_server_status PID, quit, ...); its answer."""
        exe = shutil.which("nvidia-cuda-mps-control") or "nvidia-cuda-mps-control"
        r = subprocess.run(
            [exe], input=line + "\n", env={**os.environ, **self.env}, text=True, capture_output=True, timeout=timeout_s
        )
        return r.stdout.strip()

    def faulted_servers(self) -> list[str]:
        """`PID: status` of the servers in FAULT state (a server recovering from a client's fatal fault refuses
        new clients: they fail after ~5 s with "busy or unavailable", measured on the H200)."""
        out = []
        for pid in self.command("get_server_list").split():
            if pid.isdigit() and "FAULT" in (status := self.command(f"get_server_status {pid}")):
                out.append(f"{pid}: {status}")
        return out

    def wait_ready(self, timeout_s: float = 15.0, poll_s: float = 0.1) -> tuple[float, list[str]]:
        """Wait until no server of this daemon is recovering (the next client will be taken), at most timeout_s:
        (seconds waited, the states seen while waiting)."""
        t0, seen = time.time(), []
        while self.running and time.time() - t0 < timeout_s:
            bad = self.faulted_servers()
            if not bad:
                break
            seen = seen or bad
            time.sleep(poll_s)
        return round(time.time() - t0, 2), seen

    def client_env(self, sms: int, total: int) -> dict[str, str]:
        return {**self.env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": str(mps_percentage(sms, total))}

    def stop(self) -> None:
        if self.running:
            self.running = False
            with contextlib.suppress(Exception):
                self.command("quit", timeout_s=30)
            if self._old_int is not None:
                with contextlib.suppress(ValueError):
                    signal.signal(signal.SIGINT, self._old_int)
                self._old_int = None
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> MpsDaemon:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def maybe_mps(needed: bool) -> Iterator[MpsDaemon | None]:
    if not needed:
        yield None
        return
    with MpsDaemon() as d:
        yield d


def green_contexts_available() -> str | None:
    """None when torch offers green contexts, else the reason."""
    try:
        from torch.cuda import green_contexts  # noqa: F401  torch only when asked: the module loads without it
    except Exception as e:
        return f"torch has no green contexts ({e})"
    return None


_PROBE_CLIENT = """
import sys, time, torch
n = torch.cuda.get_device_properties(0).multi_processor_count
a = torch.randn(2048, 2048, device="cuda")
t0 = time.time()
while time.time() - t0 < float(sys.argv[1]):
    a = (a @ a).tanh()
torch.cuda.synchronize()
print("ok", n, flush=True)
"""


def _run_clients(clients: list[tuple[str, str, dict[str, str]]], hold_s: float, stagger_s: float) -> dict[str, str]:
    """Start each (name, python code, environment) `stagger_s` after the previous one; the last line each printed
    ('ok <SMs seen>' for _PROBE_CLIENT) or its exit status."""

    procs = {}
    for name, code, env in clients:
        procs[name] = subprocess.Popen(
            [sys.executable, "-c", code, str(hold_s)],
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        time.sleep(stagger_s)  # the earlier client holds its context (and is at work) when the next starts
    found = {}
    for name, p in procs.items():
        try:
            out, _ = p.communicate(timeout=60 + hold_s)
        except subprocess.TimeoutExpired:
            p.kill()
            out = "timed out"
        lines = [ln for ln in out.strip().splitlines() if ln.strip()]
        found[name] = lines[-1] if lines else f"exit {p.returncode}"
    return found


def probe_coexistence(hold_s: float = 4.0, sms: int = 16) -> dict[str, str]:
    """Can an MPS client and a plain CUDA process use the GPU at the same time? Both orders are tried (the plain
    process first, then the MPS client first); each entry is 'ok <SMs seen>' or the process's last error line."""
    found: dict[str, str] = {}
    with MpsDaemon() as daemon:
        env = {
            "mps": {**os.environ, **daemon.client_env(sms, device_sm_count())},
            "plain": {k: v for k, v in os.environ.items() if not k.startswith("CUDA_MPS_")},
        }
        for order in (("plain", "mps"), ("mps", "plain")):
            seen = _run_clients([(who, _PROBE_CLIENT, env[who]) for who in order], hold_s, 1.5)
            found.update({f"{order[0]} first: {who}": line for who, line in seen.items()})
    return found


_PROBE_FAULT = """
import torch
x = torch.arange(4, device="cuda")
print(x[torch.tensor([1 << 20], device="cuda")].sum().item(), flush=True)  # an out-of-range index: a device fault
"""


def probe_containment(hold_s: float = 6.0, sms: int = 16) -> dict[str, str]:
    """What a healthy MPS client sees when another client of the same daemon faults (NVIDIA: every client of the
    server gets the fault): the last line of the neighbour and of the faulting client."""
    with MpsDaemon() as daemon:
        env = {**os.environ, **daemon.client_env(sms, device_sm_count())}
        return _run_clients([("neighbour", _PROBE_CLIENT, env), ("faulting client", _PROBE_FAULT, env)], hold_s, 2.0)


def main(argv: list[str]) -> int:
    """`python -m repro.run.smcontrol --probe-coexistence`; exit codes as docs/exit-codes.md says (2 bad input, 4 no GPU or
    MPS to probe, 1 they do not coexist)."""
    usage = "usage: python -m repro.run.smcontrol --probe-coexistence"
    if argv in (["--help"], ["-h"]):
        print(
            f"{usage}\n\nProbes this GPU's MPS: whether MPS clients and plain processes run side by side, and whether "
            "a healthy MPS client survives a neighbour's fault. Exit 0 they coexist, 1 they do not, 2 bad input, 4 no "
            "GPU or MPS to probe."
        )
        return Exit.OK
    if argv != ["--probe-coexistence"]:
        sys.stderr.write(f"repro.run.smcontrol: error: {usage}\n")
        return Exit.BAD_INPUT
    try:
        found = probe_coexistence()
        contained = probe_containment()
    except Unavailable as e:
        sys.stderr.write(f"repro.run.smcontrol: cannot run here: {e}\n")
        return Exit.NOT_RUN
    for k, v in found.items():
        print(f"{k}: {v}")
    both = all(v.startswith("ok") for v in found.values())
    print("MPS clients and plain processes coexist:", "yes" if both else "no")
    for k, v in contained.items():
        print(f"MPS fault containment, {k}: {v}")
    spared = contained["neighbour"].startswith("ok")
    print("a healthy MPS client survives a neighbour's fault:", "yes" if spared else "no")
    return exit_codes.check(both)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
