"""What a recorded run ran on: GPU, SMs, driver, torch, CUDA, compute-sanitizer, the command line."""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path

from repro.run.sanitizer import find_sanitizer

HARNESS = ("repro", "cases", "conftest.py")  # the harness's code a recorded run ran: its Python files under these


def _cmd(args: list[str]) -> str | None:
    try:
        r = subprocess.run(args, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


# What decides the probe's answer: the interpreter and the variables that pick torch, the driver and the devices.
_PROBE_VARS = ("CUDA", "NVIDIA", "PYTHON", "LD_", "PATH", "HIP", "ROCR", "TORCH")
_probed: dict[tuple, dict] = {}


def gpu_facts() -> dict:
    """Probed in a child process so the caller never initializes CUDA; once per process and environment (each probe
    imports torch: seconds), again whenever a variable that picks the interpreter's torch or the devices changed."""
    key = (sys.executable, *sorted((k, v) for k, v in os.environ.items() if k.startswith(_PROBE_VARS)))
    facts = _probed.get(key) or _probe_gpu()
    if facts.get("torch"):  # a probe that gave no answer (a timeout on a busy machine) is asked again next time
        _probed[key] = facts
    return dict(facts)


def _probe_gpu() -> dict:
    code = (
        "import json, torch\n"
        "d = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpu': None}\n"
        "if torch.cuda.is_available():\n"
        "    p = torch.cuda.get_device_properties(0)\n"
        "    d.update(gpu=p.name, sms=p.multi_processor_count, capability=f'{p.major}.{p.minor}',\n"
        "             memory_gib=round(p.total_memory / 2**30, 1))\n"
        "print(json.dumps(d))"
    )
    out = _cmd([sys.executable, "-c", code])

    return json.loads(out.splitlines()[-1]) if out else {"torch": None, "gpu": None}


def code_digest(files: list[tuple[str, bytes]]) -> str:
    """The digest of the harness's code: each Python file's path (relative to the checkout) and bytes, by path."""
    h = hashlib.sha256()
    for rel, data in sorted(files):
        h.update(rel.encode() + b"\0" + data + b"\0")
    return h.hexdigest()[:20]


def harness_code(root: Path | None = None) -> str:
    """code_digest of this checkout's harness (HARNESS): what a record says it ran, so that `records --stale` can
    check it against the commit the record is indexed at (repro.report.stale.code_at) instead of trusting it."""
    root = Path(root) if root else Path(__file__).resolve().parents[2]
    found = [p for top in HARNESS for p in ([root / top] if top.endswith(".py") else (root / top).rglob("*.py"))]
    return code_digest([(p.relative_to(root).as_posix(), p.read_bytes()) for p in found if p.is_file()])


def collect(argv: list[str] | None = None) -> dict:
    env = {
        "when": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "command": shlex.join(["python", "-m", "repro", *(argv if argv is not None else sys.argv[1:])]),
        "harness_code": harness_code(),
    }
    env.update(gpu_facts())
    smi = _cmd(["nvidia-smi", "--query-gpu=driver_version,mig.mode.current", "--format=csv,noheader"])
    if smi:
        drv, _, mig = smi.splitlines()[0].partition(",")
        env.update(driver=drv.strip(), mig_mode=mig.strip())
    san = find_sanitizer()
    if san:
        ver = _cmd([san, "--version"]) or ""
        m = re.search(r"Version (\S+)", ver)
        env["compute_sanitizer"] = m[1] if m else ver.strip()[:60]
    return env
