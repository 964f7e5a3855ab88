"""A tiny vLLM-style spec-decode test file (a test per method), for `pytest --repro-audit` and `repro audit -- pytest`
on a GPU: each test builds its method's tiny pair as the gate does (scripts/audit_examples/user_script.py's shape:
head_dim 64, GQA 4, 3 target layers, k=4), decodes with FULL CUDA graphs on vLLM's multi-process engine, and asserts
only what a vLLM test would (every request decoded its tokens); the auditor judges the captures.

    python -m pytest -p repro.vllm_integration.ci.pytest_audit --repro-audit scripts/audit_examples/test_spec_methods.py
    python -m repro audit --out OUT -- python -m pytest scripts/audit_examples/test_spec_methods.py"""

from __future__ import annotations

import argparse
import os

import pytest

from repro.vllm_integration.gate.methods import METHODS

os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")

pytest.importorskip("vllm", reason="vLLM is not installed: these are GPU tests of a vLLM build")


def _args(method: str) -> argparse.Namespace:
    return argparse.Namespace(method=method, k=4, head_dim=64, heads=4, kv_heads=1, layers=3, max_num_seqs=24,
                              capture_sizes=None, max_tokens=24, tp=1, backend="FLASH_ATTN", gpu_memory=float(os.environ.get("AUDIT_EXAMPLE_GPU_MEMORY", "0.5")), seed=0)  # fmt: skip


@pytest.mark.parametrize("method", [pytest.param(m, marks=pytest.mark.repro_audit_method(m)) for m in METHODS])
def test_speculative_decoding_decodes_every_request(method, tmp_path):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU: a GPU test of vLLM's speculative decoding")
    from user_script import run  # noqa: PLC0415  beside this file (pytest's rootdir-relative import)

    assert run(method, _args(method), tmp_path)
