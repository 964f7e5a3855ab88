"""Stand-in case workers for the executor tests: they print like a case, hang, crash, or start a grandchild."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def clean(argv):
    print('REPRO_RESULT {"passes": 1, "max_abs_err": 0.0, "wrong": false, "summary": "stand-in ' + argv[0] + '"}')
    print("env", os.environ.get("STANDIN_ENV"), "pid", os.getpid())
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
    import json

    t0 = time.time()
    time.sleep(0.2)
    phases = {"main_at": t0, "import_s": 0.05, "cuda_init_s": 0.05, "work_s": 0.1}
    print("REPRO_RESULT " + json.dumps({"passes": 1, "max_abs_err": 0.0, "wrong": False, "phases": phases}))
    return 0
