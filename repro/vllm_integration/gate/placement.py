"""Where the gate's case processes run: the devices it is given (`gate --devices`) or finds (every GPU, or every MIG
slice where MIG is on), and a pool that hands each case one device at a time.

- `--devices` absent or `none`: the one-device path as before (the process's own CUDA_VISIBLE_DEVICES, `--jobs` cases
  at once on it).
- `--devices all`: every device NVML finds (repro.run.pinning.devices_from: MIG slices when any GPU has MIG on, else the
  GPUs); `--devices 0,1` or `MIG-...,MIG-...`: those (their SM count looked up where NVML knows them).
- Several devices: every case process gets one device (CUDA_VISIBLE_DEVICES), at most `per_device` at once on it
  (`--jobs` divided over the devices, at least 1; a MIG slice takes one case at a time). A case and its reference run
  on devices of the same kind (the same SM count: `kind`; given several kinds, the run uses the most numerous: `main_kind`), so a reference is
  never compared across SM counts.
- On a MIG runner the cases go to the slices with the fewest SMs (where the defect was found), without a flag.

The cases of every speculative method (`--methods`) are cases like any other: they share the pool and `--jobs`,
each method's beside the others on one GPU.

MPS cases stay on the first device, under one daemon (gate_run.run_gate, repro.run.mps_cases): one MPS daemon per
device is not built yet.

Without `--jobs`, the number of cases at a time is fitted to the machine (fit_jobs): as many as the emptiest GPU's free
memory holds at GIB_PER_CASE a case with FREE_AT_START of it left free (what each case asks vLLM to find free at its
start), times the devices used, and no more than one a CPU core. While a build's caches are cold (its vLLM cache not
complete: each such process compiles its graphs and Triton's kernels on the CPU, 40-50 s) at most half the cores'
worth of them run at once (ColdSlots); a case on the complete caches, or a reference (no compile), starts beside
them."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from repro.errors import ConfigError, Unavailable
from repro.run import own_alloc
from repro.run.memory import MemoryBudget
from repro.run.pinning import devices_from
from repro.run.smcontrol import GpuInfo, enumerate_gpus


@dataclass(frozen=True)
class GateDevice:
    dev: str  # what CUDA_VISIBLE_DEVICES gets: an index, a GPU UUID or a MIG slice UUID
    kind: str  # gpu | mig | given
    sms: int | None = None

    def to_dict(self) -> dict:
        return {"dev": self.dev, "kind": self.kind, "sms": self.sms}


def kind_of(d: GateDevice) -> tuple[str, int | None]:
    """What makes two devices interchangeable for a case and its reference: MIG slice or GPU, and the SM count."""
    return ("mig" if d.kind == "mig" or d.dev.startswith("MIG-") else "gpu", d.sms)


def gate_devices(spec: str | None, discover: Callable[[], list[GpuInfo]] = enumerate_gpus) -> list[GateDevice]:
    """The devices of `--devices` (see the module); [] for the one-device path."""
    if spec is None or spec.strip().lower() in ("", "none"):
        return []
    try:
        gpus = discover()
        found = [GateDevice(dev, kind, sms) for dev, kind, sms in devices_from(gpus)]
    except Unavailable as e:
        if spec.strip().lower() == "all":
            raise Unavailable(f"--devices all: no device found ({e})") from None  # could not run here: exit 4
        gpus, found = [], []
    if spec.strip().lower() == "all":
        if not found:
            raise Unavailable("--devices all: NVML found no GPU")
        mig = [d for d in found if d.kind == "mig"]
        if mig:  # a MIG runner: the smallest slices, where the defect shows
            least = min(d.sms for d in mig if d.sms is not None) if any(d.sms for d in mig) else None
            return [d for d in mig if d.sms == least]
        return found
    by_id = {d.dev: d for d in found} | {str(i): d for i, d in enumerate(found) if d.kind == "gpu"}
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        if item in (d.dev for d in out):
            raise ConfigError(f"--devices: {item} named twice")
        known = by_id.get(item)
        here = {g.uuid for g in gpus} | {str(g.index) for g in gpus}  # a MIG GPU's own index or UUID too
        if item.lstrip("-").isdigit() and int(item) < 0 or found and not known and item not in here:
            # CUDA_VISIBLE_DEVICES would hide every GPU from the case: each case would fail for want of one
            names = ", ".join(sorted(set(by_id) | here)) or "none"
            raise ConfigError(f"--devices {item}: no such device here (NVML found: {names})")
        out.append(GateDevice(item, known.kind, known.sms) if known else GateDevice(item, "given", None))
    if not out:
        raise ConfigError(f"--devices {spec!r}: no device named")
    return out


class DevicePool:
    """Hands out devices to case threads: at most `per_device` holders per device, a device of the kind asked for.
    `take` blocks until one is free; `give` returns it."""

    def __init__(self, devices: list[GateDevice], per_device: int = 1):
        if not devices:
            raise ValueError("a device pool needs devices")
        self.devices = list(devices)
        self.per_device = max(1, per_device)
        self.busy = {d.dev: 0 for d in self.devices}
        self._cv = threading.Condition()

    def kinds(self) -> list[tuple[str, int | None]]:
        return list(dict.fromkeys(kind_of(d) for d in self.devices))

    def take(self, kind: tuple[str, int | None] | None = None) -> GateDevice:
        """The least busy device of that kind (any kind when None), once one has a free slot."""
        pick = [d for d in self.devices if kind is None or kind_of(d) == kind]
        if not pick:
            raise ConfigError(f"no device of kind {kind} among {[d.dev for d in self.devices]}")
        with self._cv:
            while True:
                free = [d for d in pick if self.busy[d.dev] < self.per_device]
                if free:
                    d = min(free, key=lambda x: self.busy[x.dev])
                    self.busy[d.dev] += 1
                    return d
                self._cv.wait()

    def give(self, d: GateDevice) -> None:
        with self._cv:
            self.busy[d.dev] -= 1
            self._cv.notify_all()


def main_kind(devices: list[GateDevice]) -> tuple[str, int | None]:
    """The kind of device a run uses when it is given several kinds: the one with the most devices (a tie: the fewer
    SMs). Its cases and their references all run on it."""
    kinds = [kind_of(d) for d in devices]
    return max(dict.fromkeys(kinds), key=lambda k: (kinds.count(k), -(k[1] or 0)))


def per_device_jobs(jobs: int, devices: list[GateDevice]) -> int:
    """How many cases at once on each device: `--jobs` divided over the devices; one on a MIG slice."""
    if any(kind_of(d)[0] == "mig" for d in devices):
        return 1
    return max(1, jobs // max(1, len(devices)))


GIB_PER_CASE = 4.0  # a gate case's GPU memory at its peak (1 GiB KV cache, CUDA context, graphs, compile): an estimate
# A memcheck:own case keeps each tensor in a cudaMalloc of its own and every graph's memory to its end: its allocator
# counted 12.2 GB at the peak (own_allocator.bytes_peak in results/h200-memcheck-own-gate, -guard, -poison), 12.4-13.7
# GiB a process in the CUDA out-of-memory listings of results/h200-eagle-0.20.2-0.21.0; with REPRO_OWN_ALLOC_GUARD
# each tensor sits between two guards as large as itself (up to three times that: 34.9 GiB listed there)
GIB_MEMCHECK_OWN = 16.0
GIB_MEMCHECK_OWN_GUARDED = 40.0


def case_gib(case) -> float:
    """The GPU memory one gate case's process is budgeted (GIB_PER_CASE; memcheck:own's more, its guards more again)."""
    if case.mode.sanitizer == "own" and not case.reference:
        return GIB_MEMCHECK_OWN_GUARDED if own_alloc.guard_wanted() else GIB_MEMCHECK_OWN
    return GIB_PER_CASE


FREE_AT_START = (
    0.1  # repro.vllm_integration.gate.worker's --gpu-memory: the share vLLM must find free when a case starts
)


def cpu_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 2


def fit_jobs(cpus: int, memory: list[tuple[float, float]], devices: int = 1) -> tuple[int, str]:
    """(cases at a time, why) for a machine with `cpus` cores and GPUs of (total, free) GiB, over `devices` devices."""
    by_cpu = max(1, cpus)
    if not memory:
        by_cpu = cold_jobs(cpus)  # nothing known of the GPU: as many as cold processes may run
        return by_cpu, f"{by_cpu}: half of {cpus} CPU cores (no GPU memory known)"
    total, free = min(memory, key=lambda m: m[1])
    by_mem = max(1, int((free - FREE_AT_START * total) // GIB_PER_CASE)) * max(1, devices)
    jobs = min(by_cpu, by_mem)
    return jobs, (
        f"{jobs}: GPU memory {free:.0f} of {total:.0f} GiB free at {GIB_PER_CASE:g} GiB a case, "
        f"{FREE_AT_START:.0%} left free, {max(1, devices)} device(s) ({by_mem}); one a CPU core ({by_cpu}); "
        f"at most {min(jobs, cold_jobs(cpus))} at once on a build's cold caches"
    )


def cold_jobs(cpus: int) -> int:
    """How many case processes may compile at once (a build's cold caches): half the CPU cores."""
    return max(1, cpus // 2)


class ColdSlots:
    """At most `limit` case processes that start on their build's cold caches (`warm(case)` false) run at once; a
    case that finds them warm, or a reference (it compiles nothing), starts without a slot. A case waiting for a slot
    starts as soon as its build's caches are warm (checked each `poll_s`) or a slot frees."""

    def __init__(self, limit: int, warm: Callable[[object], bool], poll_s: float = 1.0) -> None:
        self.limit, self.warm, self.poll_s = max(1, limit), warm, poll_s
        self.running = 0
        self.worst = 0  # the most cold processes at once (reports and tests)
        self._cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, case, processes: int = 1) -> Iterator[None]:
        """A slot for each of the case's `processes` (a plain case's launch-blocking rerun beside it: 2), never more
        than the limit (a case alone always runs)."""
        took, n = 0, min(max(1, processes), self.limit)
        if not getattr(case, "reference", False):
            with self._cond:
                while not self.warm(case):
                    if self.running + n <= self.limit:
                        self.running += n
                        self.worst = max(self.worst, self.running)
                        took = n
                        break
                    self._cond.wait(self.poll_s)
        try:
            yield
        finally:
            if took:
                with self._cond:
                    self.running -= took
                    self._cond.notify_all()


class ProcessSlots:
    """At most `limit` case processes at once where the gate fitted its concurrency to the machine (one a CPU core):
    a case holds a slot for each process it runs (a plain case's launch-blocking rerun beside it: 2), never more than
    the limit (a case alone always runs). limit None: no limit (an explicit --jobs counts cases, as it always has).
    The slots are a MemoryBudget of `limit` units: the same wait, cap and release."""

    def __init__(self, limit: int | None) -> None:
        self.slots = None if limit is None else MemoryBudget(max(1, limit))

    @property
    def worst(self) -> int:
        """The most processes at once (reports and tests)."""
        return self.slots.worst if self.slots is not None else 0

    def hold(self, processes: int = 1) -> contextlib.AbstractContextManager:
        return self.slots.hold(max(1, processes)) if self.slots is not None else contextlib.nullcontext()
