#!/usr/bin/env python3
"""`vllm serve` under `repro audit`, with a bounded request driver: the server (its engine core a process of its own)
on user_script.py's tiny pair, a few completions once /health answers, then SIGINT and a bounded wait, so every
process of the server exits and reports. Exits 0 when every request came back, 1 otherwise.

    python -m repro audit --out OUT --expect-method eagle -- python scripts/audit_examples/serve_driver.py --method eagle"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from user_script import TABLE, write


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--method", default="eagle")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--start-timeout", type=float, default=600)
    p.add_argument("--gpu-memory", type=float, default=float(os.environ.get("AUDIT_EXAMPLE_GPU_MEMORY", "0.5")))
    a = p.parse_args()
    shape = argparse.Namespace(head_dim=64, heads=4, kv_heads=1, layers=3)
    target, draft = write(Path(tempfile.mkdtemp(prefix="serve-example-")), a.method, shape)
    spec = TABLE[a.method].speculative_config(Path(draft) if draft else None, a.k, "FLASH_ATTN")
    # vLLM's own CLI through this Python (a `vllm` script need not be on PATH where vLLM is installed with --target)
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", target, "--port", str(a.port), "--load-format", "dummy", "--skip-tokenizer-init",
           "--max-model-len", "1024", "--max-num-seqs", "24", "--gpu-memory-utilization", str(a.gpu_memory),
           "--kv-cache-memory-bytes", str(1 << 30), "--attention-backend", "FLASH_ATTN",
           "--speculative-config", json.dumps(spec),
           "--compilation-config", json.dumps({"cudagraph_mode": "FULL_AND_PIECEWISE"})]  # fmt: skip
    server = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{a.port}"
    ok = False
    try:
        deadline = time.time() + a.start_timeout
        while time.time() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            print("the server did not come up", file=sys.stderr)
            return 1
        rng, done = random.Random(0), 0
        for _ in range(a.requests):
            body = {"model": target, "prompt": [rng.randrange(3, 4000) for _ in range(rng.randint(40, 183))],
                    "max_tokens": 24, "temperature": 0, "ignore_eos": True}  # fmt: skip
            req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
            with urllib.request.urlopen(req, timeout=120) as r:
                done += r.status == 200
        ok = done == a.requests
        print(f"{done} of {a.requests} requests answered", flush=True)
    finally:
        server.send_signal(signal.SIGINT)  # vLLM's own shutdown: the engine core exits and reports
        try:
            server.wait(timeout=120)
        except subprocess.TimeoutExpired:
            server.kill()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
