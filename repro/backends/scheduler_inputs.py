"""What FA3's get_scheduler_metadata is called with, as a hashable record: shared by the GPU backends (the replay
backend's lookup), the recorder's fixtures and the CPU model (repro.fa3_model.scheduler), so neither side imports the
other for it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchedulerInputs:
    """What get_scheduler_metadata takes (paged KV cache, varlen q through cu_seqlens_q, seqused_k)."""

    flavor: str
    query_start_loc: tuple[int, ...]
    seq_lens: tuple[int, ...]
    max_seqlen_q: int
    max_seqlen_k: int
    num_heads_q: int
    num_heads_kv: int
    head_dim: int
    page_size: int
    causal: bool
    window_left: int = -1
    num_splits: int = 0
    sm_margin: int = 0
    num_sms: int = 132  # the device's multiProcessorCount

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @classmethod
    def from_call(cls, flavor: str, num_sms: int, **call: Any) -> SchedulerInputs:
        """From the keyword arguments of Fa3Backend.scheduler_metadata (tensors or lists)."""
        qsl, sl = call["cu_seqlens_q"], call["cache_seqlens"]
        qsl, sl = (x.tolist() if hasattr(x, "tolist") else list(x) for x in (qsl, sl))
        if len(sl) != call["batch_size"]:
            raise ValueError(f"{len(sl)} seq_lens for batch {call['batch_size']}")
        return cls(
            flavor,
            tuple(qsl),
            tuple(sl),
            call["max_seqlen_q"],
            call["max_seqlen_k"],
            call["num_heads_q"],
            call["num_heads_kv"],
            call["head_dim"],
            call["page_size"],
            bool(call["causal"]),
            call["window"][0],
            call["num_splits"],
            call["sm_margin"],
            num_sms,
        )

    @classmethod
    def from_record(cls, header: dict, r: dict) -> SchedulerInputs:
        """From one line of a repro.fa3_model.record fixture."""
        return cls(
            header["backend"]["name"],
            tuple(r["query_start_loc"]),
            tuple(r["seq_lens"]),
            r["max_seqlen_q"],
            r["max_seqlen_k"],
            r["num_heads_q"],
            r["num_heads_kv"],
            r["head_dim"],
            r["page_size"],
            bool(r["causal"]),
            r["window_left"],
            r["num_splits"],
            r["sm_margin"],
            int(header["sms"]),
        )
