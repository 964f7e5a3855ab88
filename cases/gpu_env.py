"""What the GPU cases need from this machine, probed ONCE per session in one child process (never in pytest's own
process, so xdist pinning stays in force, and cheap, so each extra xdist worker pays one probe, not four)."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys

from repro.run.sanitizer import find_sanitizer

_PROBE = """
import json
out = {}
try:
    import torch
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        out["sms"], out["capability"] = p.multi_processor_count, [p.major, p.minor]
    else:
        out["gpu_error"] = "torch sees no CUDA device"
except Exception as e:
    out["gpu_error"] = f"{type(e).__name__}: {e}"
from repro.backends import load_backend
for name in ("upstream", "vllm"):
    try:
        load_backend(name)
        out[name] = None
    except Exception as e:
        out[name] = str(e)
print(json.dumps(out))
"""


PROBE_ENV = "REPRO_GPU_PROBE"  # the controller's probe, handed to the xdist workers it starts (one probe a run)


@functools.lru_cache(maxsize=1)
def probe() -> dict:
    if os.environ.get(PROBE_ENV):
        return json.loads(os.environ[PROBE_ENV])
    out = _probe()
    os.environ[PROBE_ENV] = json.dumps(out)
    return out


def _probe() -> dict:
    r = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    try:
        return json.loads(r.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        err = (r.stderr.strip().splitlines() or ["no output"])[-1]
        return {"gpu_error": f"probe failed: {err}", "upstream": err, "vllm": err}


def gpu_skip_reason() -> str | None:
    p = probe()
    if "gpu_error" in p:
        return f"no CUDA GPU: {p['gpu_error']}"
    if p["capability"][0] != 9:
        return f"FA3 needs a Hopper GPU (compute capability 9.x), found {p['capability']}"
    return None


def backend_skip_reason(name: str) -> str | None:
    err = probe().get(name)
    return f"FA3 backend {name!r} unavailable: {err}" if err else None


def sanitizer_skip_reason() -> str | None:
    return None if find_sanitizer() else "compute-sanitizer not found (CUDA toolkit)"


def mark_unrunnable(items) -> list:
    """At collection: every GPU case gets a skip mark with the reason when this machine has no usable GPU (probed
    once per process, only when GPU cases were collected). Returns the GPU cases that can run here."""
    import pytest

    gpu_items = [i for i in items if i.get_closest_marker("gpu")]
    reason = gpu_skip_reason() if gpu_items else None
    for item in gpu_items if reason else ():
        item.add_marker(pytest.mark.skip(reason=reason))
    return [i for i in gpu_items if not reason]
