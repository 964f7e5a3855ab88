"""What the plugin's hooks read off an attention metadata object: the tensors the freshness auditor compares, by
field path (backend_fields.tensor_fields; what the backend's table does not list, or a tensor it does not check, is
noted in the counters), and what the metadata was built for (its shape, its descriptor label)."""

from __future__ import annotations

from typing import Any

from repro.vllm_integration.plugin import counters
from repro.vllm_integration.plugin.backend_fields import FLASH_ATTN, BackendFields, tensor_fields, unlisted


def views_of(md: Any, spec: BackendFields = FLASH_ATTN) -> dict[str, Any]:
    """The tensors of a metadata object the auditor compares, by field path (backend_fields.tensor_fields); what the
    backend's table does not list, or a tensor that is not checked, is noted in the counters."""
    views, skipped = tensor_fields(md, spec)
    seen = counters.COUNTERS["fields_unlisted"]
    new = [p for p in unlisted(views, spec) if p not in seen.get(spec.name, [])]
    if new:
        seen[spec.name] = sorted({*seen.get(spec.name, []), *new})
    if skipped:
        counters.COUNTERS["fields_not_checked"].setdefault(spec.name, {}).update(skipped)
    return views


def _num_reqs(md: Any) -> int | None:
    qsl = getattr(md, "query_start_loc", None)
    if qsl is not None and hasattr(qsl, "shape"):
        return qsl.shape[0] - 1
    parts = [getattr(md, k, None) for k in ("num_decodes", "num_prefills")]  # FlashInfer
    if all(isinstance(p, int) for p in parts):
        return sum(parts)
    seq = getattr(md, "seq_lens", None)
    return seq.shape[0] if seq is not None and hasattr(seq, "shape") else None


def _shape(md: Any) -> dict[str, Any]:
    tokens = getattr(md, "num_actual_tokens", None)
    return {
        "num_actual_tokens": tokens if isinstance(tokens, int) else None,
        "num_reqs": _num_reqs(md),
        "max_query_len": getattr(md, "max_query_len", 1),
        "max_seq_len": getattr(md, "max_seq_len", 1 << 30),
        # a per-request tensor of causal flags names no one layout: the decoding of FA3's fields assumes causal
        "causal": causal if isinstance(causal := getattr(md, "causal", True), bool) else True,
    }


def label_of(md: Any) -> str:
    """The descriptor label of a metadata object: t<tokens>r<requests>."""
    s = _shape(md)
    return f"t{getattr(md, 'num_actual_tokens', '?')}r{s['num_reqs']}"


def fields_of(md: Any) -> dict[str, Any]:
    """The object fields of a metadata object the descriptor check compares (num_actual_tokens, num_reqs,
    max_query_len), as they are now; a field the object does not have is left out."""
    s = _shape(md)
    return {k: s[k] for k in ("num_actual_tokens", "num_reqs") if isinstance(s[k], int)} | (
        {"max_query_len": s["max_query_len"]} if isinstance(getattr(md, "max_query_len", None), int) else {}
    )


def build_shape(builder: Any, md: Any) -> dict[str, Any]:
    """What a build's metadata was built for (its shape, and the builder's head dim): what decodes its FA3 layout."""
    return {**_shape(md), "head_dim": getattr(builder, "headdim", 128)}
