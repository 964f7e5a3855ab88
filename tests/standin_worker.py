"""Stand-in case workers for the executor tests: they print like a case, hang, crash, or start a grandchild."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from repro.contract.channel import emit  # records go where a case's go: the structured channel its parent named
from repro.contract.tags import RESULT_TAG


def clean(argv):
    emit(RESULT_TAG, {"passes": 1, "max_abs_err": 0.0, "wrong": False, "summary": "stand-in " + argv[0]})
    print("env", os.environ.get("STANDIN_ENV"), "pid", os.getpid(), "injected", os.environ.get("NV_SANITIZER_STANDIN"))
    print("gpu", os.environ.get("CUDA_VISIBLE_DEVICES"))
    return 0


def hang(argv):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(argv[0], "w") as f:
        f.write(str(child.pid))
    time.sleep(600)


def crash(argv):
    print("torch.AcceleratorError: CUDA error: an illegal memory access was encountered", file=sys.stderr)
    raise SystemExit(1)


def boom(argv):
    raise ValueError("stand-in failure")


def phased(argv):

    t0 = time.time()
    time.sleep(0.2)
    phases = {"main_at": t0, "import_s": 0.05, "cuda_init_s": 0.05, "work_s": 0.1}
    emit(RESULT_TAG, {"passes": 1, "max_abs_err": 0.0, "wrong": False, "phases": phases})
    return 0


def memcheck_finding(argv):
    """Write a recorded memcheck log (argv[0]) to the stand-in sanitizer's log: its first error cut in the middle,
    a pause, the rest; then hang as a stale case may."""
    text = open(argv[0]).read()
    first = text.index("Invalid ")
    cut = text.index("nearest allocation", first)
    with open(os.environ["STANDIN_SANITIZER_LOG"], "a") as log:
        log.write(text[:cut])
        log.flush()
        print("wrote half", time.time(), flush=True)
        time.sleep(float(argv[1]))
        log.write(text[cut:])
        log.flush()
        print("wrote all", time.time(), flush=True)
    time.sleep(600)
