"""The spec-decode case a worker process runs on the GPU: capture under a strategy, decode, compare with eager."""

from __future__ import annotations

import time
from typing import Any

from repro.case.spec import CaseSpec
from repro.contract.tags import FIRST_STALE
from repro.specdecode.models import ModelConfig

PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42, 43, 44]]


def model_config(spec: CaseSpec) -> ModelConfig:
    c = spec.cfg
    return ModelConfig(
        vocab=4096,
        hidden=1024,
        layers=2,
        q_heads=c.num_heads_q,
        kv_heads=c.num_heads_kv,
        head_dim=c.head_dim,
        intermediate=2048,
        seed=spec.seed,
    )


def run_spec_case(spec: CaseSpec, backend: Any, margin: int, poison: Any, emit, max_new: int = 32) -> dict:
    import torch  # torch in the case process only

    from repro.specdecode.runner import SpecDecodeRunner, compare_runs  # imports torch: in the case process only

    mcfg = model_config(spec)
    dev = torch.device("cuda", 0)

    def runner(strategy: str, graphs: bool) -> SpecDecodeRunner:
        return SpecDecodeRunner(
            mcfg,
            spec.cfg,
            backend,
            backend,
            dev,
            strategy=strategy,
            sm_margin=margin,
            poison=poison,
            dtype=torch.bfloat16,
            use_graphs=graphs,
        )

    run = runner(spec.strategy, True)
    run.on_pass = lambda e: emit(
        {
            "descriptor": e.descriptor.label,
            "stage": e.stage,
            "model": e.model,
            "buffer_holds": e.buffer_holds.label,
            "stale_entries": int(e.stale),
        }
    )
    t0 = time.perf_counter()
    events = run.capture()
    capture_s = time.perf_counter() - t0
    stale_passes = [e for e in events if e.stale]
    graph = run.generate(PROMPTS, max_new)
    eager = runner("fresh", False)
    eager.capture()
    ref = eager.generate(PROMPTS, max_new)
    greedy = eager.greedy_reference(PROMPTS, max_new)
    same = graph.tokens == ref.tokens
    cmp = compare_runs(graph, ref)
    return {
        "passes": len(events),
        "max_abs_err": cmp["max_logit_err"],
        "tolerance": cmp["logit_tolerance"],
        "worst_descriptor": None,
        "wrong": cmp["wrong"],
        "comparison": cmp,
        "stale_fields": {"draft_prefill_stale_passes": len(stale_passes)} if stale_passes else {},
        "first_diffs": [
            f"{e.descriptor.label}: {e.model} {e.stage} ran on buffers holding {e.buffer_holds.label}"
            for e in stale_passes[:3]
        ],
        FIRST_STALE: stale_passes[0].descriptor.label if stale_passes else None,
        "summary": (
            f"graph tokens {'==' if same else '!='} eager tokens ({len(PROMPTS)}x{max_new}); draft proposals differ "
            f"in {cmp['proposal_steps_differ']} of {cmp['steps']} verify steps; max |target logits graph - eager| "
            f"{cmp['max_logit_err']:.3g}; "
            f"{graph.replays} replays; acceptance {graph.accepted}/{graph.proposed}; "
            f"graph {graph.tokens_per_s:.0f} tok/s vs eager {ref.tokens_per_s:.0f} tok/s; "
            f"greedy target-only {'equal' if greedy == ref.tokens else 'differs (bf16 batch shapes)'}"
        ),
        "graph_tokens_per_s": graph.tokens_per_s,
        "eager_tokens_per_s": ref.tokens_per_s,
        "replays": graph.replays,
        "capture_s": capture_s,
        "tokens_equal": same,
        "greedy_equal": greedy == ref.tokens,
        "acceptance": [graph.accepted, graph.proposed],
        "tokens": graph.tokens,
    }
