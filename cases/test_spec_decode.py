"""GPU cases with real models: a Llama-style target and an EAGLE draft captured like vLLM's V2 runner, then greedy
speculative decoding with graph replay. Stale (the draft prefill reuses the target's attention states) must be seen
(a fault, or the capture audit); fresh must fault nowhere and give tokens equal to an eager run."""

from __future__ import annotations

import pytest

from cases.controls import run_control
from repro.case import CaseSpec, SmConfig
from repro.descriptors import AttnConfig

SHAPES = [  # (q heads, kv heads, head dim): GQA ratio 4, 1 and 8
    pytest.param((32, 8, 128), id="h32-8x128"),
    pytest.param((16, 16, 128), id="h16-16x128"),
    pytest.param((32, 4, 64), id="h32-4x64"),
]


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize(
    "capture_sizes", [pytest.param((1, 2, 4, 8, 16, 32, 64), id="cap1-64"), pytest.param((4, 8, 16), id="cap4-16")]
)
@pytest.mark.parametrize("page_size", [pytest.param(16, id="page16"), pytest.param(64, id="page64")])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("spec_tokens", [pytest.param(1, id="k1"), pytest.param(3, id="k3")])
@pytest.mark.parametrize("sm", [pytest.param("sm_margin:16", id="smmargin16"), pytest.param("full", id="sm-all")])
@pytest.mark.parametrize("strategy", [pytest.param("stale", id="stale"), pytest.param("fresh", id="fresh")])
@pytest.mark.parametrize("backend", [pytest.param("vllm", id="vllm"), pytest.param("upstream", id="upstream")])
def test_stale_metadata_spec_decode(
    backend, strategy, sm, spec_tokens, shape, page_size, capture_sizes, record_property
):
    hq, hkv, d = shape
    cfg = AttnConfig(
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim=d,
        page_size=page_size,
        num_speculative_tokens=spec_tokens,
        capture_sizes=capture_sizes,
        max_num_seqs=64,
    )
    spec = CaseSpec(
        backend,
        strategy,
        "eager",
        scenario="spec-decode",
        sm=SmConfig.parse(sm),
        cfg=cfg,
        poison="int-max",
        timeout_s=300,
    )
    run_control(spec, record_property)
