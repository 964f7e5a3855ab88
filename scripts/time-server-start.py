"""Where a forkserver's start-up goes on this machine: torch, the harness, each FA3 library's load and hash."""

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
t = time.time()


def lap(what):
    global t
    now = time.time()
    print(f"{what:<28} {now - t:6.2f} s", flush=True)
    t = now


import torch  # noqa: E402

lap("import torch")
import repro.attention.worker  # noqa: E402, F401

lap("import repro.attention.worker")
from repro.backends import load_backend  # noqa: E402
from repro.backends.base import _sha256  # noqa: E402
from repro.backends.vllm_fork import find_vllm_libs  # noqa: E402

for name in ("upstream", "vllm"):
    try:
        load_backend(name)
        lap(f"load {name} (with hash)")
    except Exception as e:
        lap(f"{name}: {e}")
libs = [sys.modules["flash_attn_3._C"].__file__] if "flash_attn_3._C" in sys.modules else []
for lib in libs + list(find_vllm_libs().values()):
    _sha256.__wrapped__(lib, 0, 0)
    lap(f"hash again {os.path.getsize(lib) >> 20} MiB")
print("cuda initialized before fork:", torch.cuda.is_initialized())
