"""`python -m repro doctor`: GPU, SMs, MIG slices, MPS, compute-sanitizer, FA3 backends, and fixes."""

from __future__ import annotations

import shutil
import subprocess
import sys

from repro.errors import Unavailable
from repro.report.environment import gpu_facts
from repro.run import server
from repro.run.sanitizer import find_sanitizer
from repro.run.smcontrol import enumerate_gpus, green_contexts_available


def _probe_backend(name: str) -> str:
    code = (
        f"from repro.backends import load_backend\n"
        f"try:\n    print('ok', load_backend({name!r}).identity().short())\n"
        f"except Exception as e:\n    print('missing', e)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return r.stdout.strip() or r.stderr.strip().splitlines()[-1] if (r.stdout or r.stderr) else "no answer"


def doctor(say=None) -> str:
    """What this machine can run, a line per fact; `say` is handed each line as soon as it is known (the probes
    take seconds: torch, NVML, each FA3 build in a child process)."""
    lines: list[str] = []

    def add(line: str) -> None:
        lines.append(line)
        if say is not None:
            say(line)

    facts = gpu_facts()
    add(f"torch:             {facts.get('torch') or 'not installed (pip install torch)'} (CUDA {facts.get('cuda')})")
    if facts.get("gpu"):
        add(f"GPU:               {facts['gpu']}, {facts['sms']} SMs, compute capability {facts['capability']}")
        if facts.get("capability") != "9.0":
            add("                   FA3 needs Hopper (9.0): GPU cases will skip")
    else:
        add("GPU:               none visible; GPU cases skip; `python -m repro matrix` predicts with the CPU model")
    try:
        gpus = enumerate_gpus()
        for g in gpus:
            add(f"NVML GPU {g.index}:        {g.name} MIG {'on' if g.mig_mode else 'off'}, {len(g.slices)} slices")
            for s in g.slices:
                add(f"  slice {s.index}: {s.profile} {s.sms} SMs {s.memory_mib} MiB {s.uuid}")
    except Unavailable as e:
        add(f"NVML:              {e}")
    add(f"green contexts:    {_green_line(facts)}")
    mps = shutil.which("nvidia-cuda-mps-control")
    add(f"MPS:               {mps or 'nvidia-cuda-mps-control not found: MPS cases skip'}")
    san = find_sanitizer()
    add(f"compute-sanitizer: {san or 'not found: install the CUDA toolkit or put it on PATH'}")
    for b in ("upstream", "vllm"):
        add(f"{'FA3 ' + b + ':':<19}{_probe_backend(b)}")
    can_run = bool(facts.get("gpu")) and facts.get("capability") == "9.0"
    add(f"repro server:      {_server_line(can_run)}")
    if not can_run:  # what a machine without a Hopper GPU can still answer
        add(
            "here you can run:  `vllm-check WHEEL_OR_CHECKOUT` (is a build affected, from its sources), `bisect` "
            "(the first bad commit of a checkout), `matrix` (the CPU model's predicted table), the CPU tests"
        )
    return "\n".join(lines)


def _green_line(facts: dict) -> str:
    """Green contexts need torch's CUDA build and a GPU; a CPU-only torch has the module but cannot make one."""
    if facts.get("torch") and not facts.get("cuda"):
        return f"not available: torch {facts['torch']} is a CPU-only build (green:N cases skip)"
    if not facts.get("gpu"):
        return "not available: no CUDA GPU visible (green:N cases skip)"
    green = green_contexts_available()
    return "available in torch" if green is None else green


def _server_line(can_run: bool = True) -> str:
    """The repro server: whether one runs this code; recommended only where GPU cases can run."""

    if not can_run:
        facts, _ = server.usable()
        held = f"pid {facts['pid']} runs, but " if facts else ""
        return f"{held}of no use here: no GPU case runs on this machine (the CPU model needs no server)"
    path = server.socket_path()
    if path is None:
        return f"{server.SOCKET_ENV}=off"
    facts = server.running(path)  # one probe: a server that refused answers once, then exits
    if facts is None:
        return "none (`python -m repro serve`: verdicts in seconds)"
    if facts["refused"]:
        return f"pid {facts['pid']} refused to serve ({facts['refused']}) and has exited"
    if facts["fingerprint"] != server.code_fingerprint():
        return f"pid {facts['pid']} runs other code or FA3 libraries than this command (restart it: serve)"
    busy = " (it serves another command now: one at a time)" if facts["busy"] else ""
    return f"pid {facts['pid']}, runs this code: matrix forks its cases from it{busy}"
