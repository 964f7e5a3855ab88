"""Pin each pytest-xdist worker to one GPU or MIG slice BEFORE CUDA initializes (conftest calls this).

Worker gwN takes device N modulo the count. Devices are MIG slice UUIDs when any GPU has MIG on, else GPU UUIDs
(or indices). REPRO_DEVICES="uuid1,uuid2" overrides discovery; a worker whose CUDA_VISIBLE_DEVICES is already set
by the user is left alone."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

from repro.errors import Unavailable
from repro.run.smcontrol import GpuInfo, enumerate_gpus

PINNED_VAR = "REPRO_PINNED_DEVICE"  # the device pinned to this worker (runner.worker_env reads it for mig cases)
DEVICES_VAR = "REPRO_DEVICES"  # the devices to pin workers to, instead of discovery (pytest_gate reads it too)


@dataclass(frozen=True)
class Pin:
    worker: str
    device: str  # what CUDA_VISIBLE_DEVICES gets
    kind: str  # mig | gpu | override
    sms: int | None = None


def worker_index(worker_id: str) -> int | None:
    m = re.fullmatch(r"gw(\d+)", worker_id or "")
    return int(m[1]) if m else None


def devices_from(gpus: list[GpuInfo]) -> list[tuple[str, str, int | None]]:
    slices = [(s.uuid, "mig", s.sms) for g in gpus for s in g.slices]
    if slices:
        return slices
    return [(g.uuid or str(g.index), "gpu", g.sms) for g in gpus]


def choose_pin(
    worker_id: str, env: MutableMapping[str, str], discover: Callable[[], list[GpuInfo]] = enumerate_gpus
) -> Pin | None:
    """The device for this worker, or None (not an xdist worker, user already pinned, nothing found)."""
    idx = worker_index(worker_id)
    if idx is None or env.get("CUDA_VISIBLE_DEVICES"):
        return None
    if env.get(DEVICES_VAR):
        devs = [(d.strip(), "override", None) for d in env[DEVICES_VAR].split(",") if d.strip()]
    else:
        try:
            devs = devices_from(discover())
        except Unavailable:
            return None
    if not devs:
        return None
    dev, kind, sms = devs[idx % len(devs)]
    return Pin(worker_id, dev, kind, sms)


def apply_pin(pin: Pin | None, env: MutableMapping[str, str] = os.environ) -> None:
    if pin is None:
        visible = env.get("CUDA_VISIBLE_DEVICES", "")
        if visible.startswith("MIG-") and "," not in visible:  # the user pinned this process to one slice
            env.setdefault(PINNED_VAR, visible)
        return
    env["CUDA_VISIBLE_DEVICES"] = pin.device
    env[PINNED_VAR] = pin.device
