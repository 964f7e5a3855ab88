#!/usr/bin/env python3
"""A person's own speculative-decoding vLLM script, not one of the gate's pairs, for `repro audit` on a GPU: tiny
models built as the gate builds its pairs (a config.json per model folder, repro.vllm_integration.gate.methods'
architectures, vLLM's dummy weights: no hub, no download), with another shape: by default a 3-layer Llama target with
head_dim 64 and 4 query heads over 1 KV head (GQA 4), k=4 speculative tokens, max_num_seqs 24, vLLM's own capture
sizes, FULL_AND_PIECEWISE, vLLM's multi-process engine on (its default), 12 prompts of 40-183 token ids.

    python -m repro audit --out OUT --expect-method eagle -- python scripts/audit_examples/user_script.py --method eagle

Options change the method, the shape (head dim, heads, KV heads, layers), k (1-5), the capture sizes, max_num_seqs,
the engine's process layout (--mp off: the engine in this process; --spawn: the engine core spawned; --twice: `LLM`
used twice, the second with --second-method; --tp N: tensor parallel over N GPUs). Exits 0 once every request
decoded its tokens, 1 otherwise: the script's own verdict, which `repro audit` keeps apart from the audit's."""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from repro.vllm_integration.gate.methods import METHODS, TABLE


def configs(method: str, a: argparse.Namespace) -> dict[str, dict]:
    """The method's model configs (folder name -> config) in this script's shape."""
    shape = {"num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "hidden_size": a.heads * a.head_dim}
    out = {}
    for name, cfg in TABLE[method].models():
        cfg = {**cfg, **shape}
        if "head_dim" in cfg:
            cfg["head_dim"] = a.head_dim
        if name.startswith("target"):
            cfg["num_hidden_layers"] = a.layers
        if "eagle_aux_hidden_state_layer_ids" in cfg:  # EAGLE3 reads the target's first, middle and last layers
            cfg["eagle_aux_hidden_state_layer_ids"] = [0, a.layers // 2, a.layers - 1]
        if "dflash_config" in cfg:
            cfg["dflash_config"] = {**cfg["dflash_config"], "target_layer_ids": [0, a.layers - 1]}
        out[name] = cfg
    return out


def write(root: Path, method: str, a: argparse.Namespace) -> tuple[str, str | None]:
    paths = []
    for name, cfg in configs(method, a).items():
        (root / name).mkdir(parents=True, exist_ok=True)
        (root / name / "config.json").write_text(json.dumps(cfg, indent=1))
        paths.append(str(root / name))
    return paths[0], (paths[1] if len(paths) > 1 else None)


def run(method: str, a: argparse.Namespace, root: Path) -> bool:
    from vllm import LLM, SamplingParams  # noqa: PLC0415  vLLM after the environment is set

    target, draft = write(root / method, method, a)
    compilation = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    if a.capture_sizes:
        compilation["cudagraph_capture_sizes"] = [int(x) for x in a.capture_sizes.split(",")]
    llm = LLM(
        model=target,
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=a.max_num_seqs,
        gpu_memory_utilization=a.gpu_memory,
        kv_cache_memory_bytes=1 << 30,
        tensor_parallel_size=a.tp,
        attention_backend=a.backend,
        speculative_config=TABLE[method].speculative_config(Path(draft) if draft else None, a.k, a.backend),
        compilation_config=compilation,
        seed=0,
    )
    rng = random.Random(a.seed)
    prompts = [{"prompt_token_ids": [rng.randrange(3, 4000) for _ in range(rng.randint(40, 183))]} for _ in range(12)]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True, detokenize=False)
    outs = llm.generate(prompts, params)
    ok = all(len(o.outputs[0].token_ids) == a.max_tokens for o in outs)
    print(f"{method}: {len(outs)} requests, every one {a.max_tokens} tokens: {ok}", flush=True)
    shutdown = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if shutdown is not None and hasattr(shutdown, "shutdown"):
        shutdown.shutdown()  # the engine core exits (and reports) before the next engine starts
    del llm
    gc.collect()
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--method", choices=METHODS, default="eagle")
    p.add_argument("--second-method", choices=METHODS, help="with --twice: the second LLM's method (default --method)")
    p.add_argument("--k", type=int, default=4, choices=range(1, 6), help="speculative tokens (1-5, default 4)")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=24)
    p.add_argument("--capture-sizes", help="cudagraph_capture_sizes, comma-separated (default: vLLM's)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mp", choices=("on", "off"), default="on", help="vLLM's multi-process engine (default on)")
    p.add_argument("--spawn", action="store_true", help="the engine core spawned (VLLM_WORKER_MULTIPROC_METHOD)")
    p.add_argument("--twice", action="store_true", help="`LLM` used twice in this script")
    p.add_argument("--tp", type=int, default=1, help="tensor parallel size (GPUs)")
    p.add_argument("--backend", default="FLASH_ATTN")
    p.add_argument("--gpu-memory", type=float, default=float(os.environ.get("AUDIT_EXAMPLE_GPU_MEMORY", "0.5")))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--models", help="folder for the model configs (default: a new temp folder)")
    a = p.parse_args()
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if a.mp == "on" else "0"
    if a.spawn:
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    root = Path(a.models or tempfile.mkdtemp(prefix="audit-example-"))
    ok = run(a.method, a, root)
    if a.twice:
        ok = run(a.second_method or a.method, a, root) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
