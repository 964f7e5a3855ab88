"""Which kernels of the gate's model give non-finite or wrong results under MPS at a given SM count (the mps:24
reference decoded NaN with every weight set, results/h200-agree-exact-first-source)? Runs the model's bf16 GEMM
shapes, softmax and vLLM's FA3 varlen attention (prefill of the gate's four prompts, then one decode step) in a child
per SM configuration, each against a float32 CPU reference, and prints one JSON line per configuration.

  python scripts/mps-finite-probe.py --vllm PREFIX [--sms 16,24,32]     (PREFIX holds vllm/ with its FA3)"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r"""
import json, torch
torch.manual_seed(0)
out = {"sms": torch.cuda.get_device_properties(0).multi_processor_count}
dev = "cuda"
for m in (1, 4, 16, 19):
    for k, n in ((1024, 1536), (1024, 4096), (2048, 1024), (1024, 1024)):
        a, b = torch.randn(m, k), torch.randn(n, k) * k ** -0.5
        got = (a.to(dev, torch.bfloat16) @ b.to(dev, torch.bfloat16).T).float().cpu()
        want = a.bfloat16().float() @ b.bfloat16().float().T
        out[f"gemm {m}x{k}x{n}"] = [bool(torch.isfinite(got).all()), round(float((got - want).abs().max()), 3)]
x = torch.randn(4, 4096)
got = torch.log_softmax(x.to(dev), -1).cpu()
out["log_softmax"] = [bool(torch.isfinite(got).all()), round(float((got - torch.log_softmax(x, -1)).abs().max()), 5)]
try:
    from vllm.vllm_flash_attn import flash_attn_varlen_func
    lens, h, kvh, d = [7, 3, 5, 4], 8, 2, 128
    for name, qlens in (("prefill", lens), ("decode", [1, 1, 1, 1])):
        klens = lens if name == "prefill" else [n + 1 for n in lens]
        cq = torch.tensor([0] + qlens).cumsum(0).int()
        ck = torch.tensor([0] + klens).cumsum(0).int()
        q = torch.randn(int(cq[-1]), h, d).bfloat16()
        k = torch.randn(int(ck[-1]), kvh, d).bfloat16()
        v = torch.randn(int(ck[-1]), kvh, d).bfloat16()
        got = flash_attn_varlen_func(q.to(dev), k.to(dev), v.to(dev), max(qlens), cq.to(dev), max(klens),
                                     cu_seqlens_k=ck.to(dev), causal=True, fa_version=3).float().cpu()
        want = []
        for i in range(4):
            qi, ki, vi = q[cq[i]:cq[i + 1]].float(), k[ck[i]:ck[i + 1]].float(), v[ck[i]:ck[i + 1]].float()
            ki, vi = ki.repeat_interleave(h // kvh, 1), vi.repeat_interleave(h // kvh, 1)
            s = torch.einsum("qhd,khd->hqk", qi, ki) * d ** -0.5
            off = ki.shape[0] - qi.shape[0]
            mask = torch.arange(ki.shape[0])[None, :] > (torch.arange(qi.shape[0])[:, None] + off)
            s = s.masked_fill(mask[None], float("-inf"))
            want.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), vi))
        want = torch.cat(want)
        out[f"fa3 {name}"] = [bool(torch.isfinite(got).all()), round(float((got - want).abs().max()), 4)]
except Exception as e:
    out["fa3"] = f"{type(e).__name__}: {e}"[:300]
print("PROBE " + json.dumps(out), flush=True)
"""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--vllm", required=True)
    p.add_argument("--sms", default="16,24,32")
    a = p.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from repro.run.smcontrol import MpsDaemon, device_sm_count

    total = device_sm_count()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([a.vllm, os.environ.get("PYTHONPATH", "")])}
    runs = [("full", None)] + [(f"mps:{n}", int(n)) for n in a.sms.split(",")]
    with MpsDaemon() as mps:
        for label, sms in runs:
            e = dict(env) if sms is None else {**env, **mps.client_env(sms, total)}
            r = subprocess.run([sys.executable, "-c", CHILD], env=e, capture_output=True, text=True, timeout=120)
            line = next((x[6:] for x in r.stdout.splitlines() if x.startswith("PROBE ")), None)
            rec = json.loads(line) if line else {"error": (r.stderr or r.stdout)[-400:]}
            print(json.dumps({"config": label, **rec}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
