"""The freshness auditor as a vLLM plugin (entry point group `vllm.general_plugins`, enabled by REPRO_AUDIT=1).

It wraps FlashAttentionMetadataBuilder.build (record what each build's views show) and FlashAttentionImpl.forward
(before every eager forward, check the metadata's views still show it). Findings go to stderr as
`REPRO_AUDIT <json>` lines and, at exit, to REPRO_AUDIT_FILE when set. Written against the class and attribute
names of vllm/v1/attention/backends/flash_attn.py; anything it cannot find is reported, never guessed."""

from __future__ import annotations

import atexit
import json
import os
import sys
from typing import Any

from repro.vllm_integration.audit import FreshnessAuditor

ENV, FILE_ENV = "REPRO_AUDIT", "REPRO_AUDIT_FILE"
AUDITOR = FreshnessAuditor()
_installed = False


def _views(md: Any) -> dict[str, Any]:
    return {name: getattr(md, name, None) for name in ("query_start_loc", "seq_lens", "scheduler_metadata")}


def _shape(md: Any) -> dict[str, Any]:
    qsl = getattr(md, "query_start_loc", None)
    return {
        "num_reqs": (qsl.shape[0] - 1) if qsl is not None else None,
        "max_query_len": getattr(md, "max_query_len", 1),
        "max_seq_len": getattr(md, "max_seq_len", 1 << 30),
        "causal": getattr(md, "causal", True),
    }


def _label(md: Any) -> str:
    s = _shape(md)
    return f"t{getattr(md, 'num_actual_tokens', '?')}r{s['num_reqs']}"


def _emit(obj: dict) -> None:
    sys.stderr.write(f"REPRO_AUDIT {json.dumps(obj)}\n")


def install(module: Any) -> None:
    """Patch a flash_attn backend module (passed in so tests can hand it a stand-in)."""
    global _installed
    builder_cls = getattr(module, "FlashAttentionMetadataBuilder", None)
    impl_cls = getattr(module, "FlashAttentionImpl", None)
    if builder_cls is None or impl_cls is None:
        _emit({"error": f"{module.__name__}: FlashAttentionMetadataBuilder/FlashAttentionImpl not found"})
        return
    orig_build, orig_forward = builder_cls.build, impl_cls.forward

    def build(self, *args: Any, **kwargs: Any):
        md = orig_build(self, *args, **kwargs)
        shape = _shape(md)
        shape["head_dim"] = getattr(self, "headdim", 128)
        AUDITOR.record_build(id(md), _label(md), _views(md), shape)
        return md

    def forward(
        self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any, *a: Any, **k: Any
    ):
        if attn_metadata is not None and not _capturing():
            for m in AUDITOR.check(id(attn_metadata), _views(attn_metadata)):
                _emit({"stale": m.to_dict(), "message": str(m)})
        return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **k)

    builder_cls.build, impl_cls.forward = build, forward
    _installed = True


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _write_report() -> None:
    path = os.environ.get(FILE_ENV)
    _emit({"summary": AUDITOR.report(), "checks": AUDITOR.checks, "stale": len(AUDITOR.mismatches)})
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "checks": AUDITOR.checks,
                    "mismatches": [m.to_dict() for m in AUDITOR.mismatches],
                    "summary": AUDITOR.report(),
                },
                f,
                indent=1,
            )


def register() -> None:
    """vLLM calls this in every process it starts (general plugins)."""
    if os.environ.get(ENV) != "1" or _installed:
        return
    try:
        from vllm.v1.attention.backends import flash_attn
    except ImportError as e:
        _emit({"error": f"cannot import vLLM's FlashAttention backend: {e}"})
        return
    install(flash_attn)
    atexit.register(_write_report)
