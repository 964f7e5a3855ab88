"""A backend that answers get_scheduler_metadata from buffers recorded on a GPU (repro.record).

It lets the CPU tier run the builder, layouts, poison and stale diffs on what FA3 really returned, padding
entries included. It has no forward: cases that launch kernels need a real backend."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from repro.backends.base import BackendIdentity, BackendUnavailable


def _key(batch, qsl, seq_lens, max_seqlen_q, max_seqlen_k, hq, hkv, d, page, causal, window_left, splits, margin):
    return (
        batch,
        tuple(qsl),
        tuple(seq_lens),
        max_seqlen_q,
        max_seqlen_k,
        hq,
        hkv,
        d,
        page,
        bool(causal),
        window_left,
        splits,
        margin,
    )


def load_records(path: str | Path) -> tuple[dict, list[dict]]:
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or not lines[0].get("header"):
        raise ValueError(f"{path}: not a repro.record file")
    return lines[0], lines[1:]


class ReplayBackend:
    def __init__(self, path: str | Path) -> None:
        self.header, self.records = load_records(path)
        ident = self.header["backend"]
        self.flavor = ident["name"]
        self.name = f"replay-{self.flavor}"
        self._identity = BackendIdentity(
            self.name, ident["package"], ident["version"], ident["library"], ident["sha256"]
        )
        self._table = {
            _key(
                r["batch"],
                r["query_start_loc"],
                r["seq_lens"],
                r["max_seqlen_q"],
                r["max_seqlen_k"],
                r["num_heads_q"],
                r["num_heads_kv"],
                r["head_dim"],
                r["page_size"],
                r["causal"],
                r["window_left"],
                r["num_splits"],
                r["sm_margin"],
            ): r
            for r in self.records
        }

    @property
    def sms(self) -> int:
        return int(self.header["sms"])

    def identity(self) -> BackendIdentity:
        return self._identity

    def scheduler_metadata(
        self,
        *,
        batch_size,
        max_seqlen_q,
        max_seqlen_k,
        num_heads_q,
        num_heads_kv,
        head_dim,
        cache_seqlens,
        cu_seqlens_q,
        page_size,
        causal,
        window,
        num_splits,
        sm_margin,
        dtype,
    ) -> Any:
        import torch

        key = _key(
            batch_size,
            cu_seqlens_q.tolist(),
            cache_seqlens.tolist(),
            max_seqlen_q,
            max_seqlen_k,
            num_heads_q,
            num_heads_kv,
            head_dim,
            page_size,
            causal,
            window[0],
            num_splits,
            sm_margin,
        )
        rec = self._table.get(key)
        if rec is None:
            raise KeyError(f"no recorded metadata for b={batch_size} splits={num_splits} margin={sm_margin}")
        return torch.tensor(rec["metadata"], dtype=torch.int32, device=cache_seqlens.device)

    def forward(self, *a: Any, **k: Any) -> Any:
        raise BackendUnavailable("the replay backend has no kernels")
