"""What the GPU cases need from this machine, probed once per session in child processes (never in pytest's own
process, so xdist pinning stays in force)."""

from __future__ import annotations

import functools
import subprocess
import sys

from repro.sanitizer import find_sanitizer
from repro.smcontrol import Unavailable


@functools.cache
def gpu_skip_reason() -> str | None:
    from repro.runner import device_sm_count

    try:
        device_sm_count()
    except (Unavailable, subprocess.SubprocessError, OSError) as e:
        return f"no CUDA GPU: {e}"
    code = "import torch; p = torch.cuda.get_device_properties(0); print(p.major, p.minor)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    if r.stdout.split()[:1] != ["9"]:
        return f"FA3 needs a Hopper GPU (compute capability 9.x), found {r.stdout.strip()}"
    return None


@functools.cache
def backend_skip_reason(name: str) -> str | None:
    code = f"from repro.backends import load_backend\nload_backend({name!r})\n"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    if r.returncode == 0:
        return None
    last = (r.stderr.strip().splitlines() or ["unknown error"])[-1]
    return f"FA3 backend {name!r} unavailable: {last}"


def sanitizer_skip_reason() -> str | None:
    return None if find_sanitizer() else "compute-sanitizer not found (CUDA toolkit)"
