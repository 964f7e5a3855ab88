"""FA3 AOT scheduler-metadata layouts: which int32 vectors a buffer holds, where, and how to decode it.

Upstream FA3 (flash_attn_3):  num_splits_dynamic | num_m_blocks | varlen_batch_idx (not local) |
                              num_nheads_in_l2 (causal or local) | semaphore
vLLM's fork (_vllm_fa3_C):    prepare_seqlen_q | num_splits_dynamic (num_splits > 1 and b <= 992) |
                              num_nheads_in_l2 (causal or local) | semaphore
Every vector holds round_up(b, 4) entries; entries [b, round_up(b, 4)) are never written by FA3.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

UPSTREAM = "upstream"
VLLM = "vllm"
FLAVORS = (UPSTREAM, VLLM)
MAX_BATCHES_1CTA = 992  # PREPARE_VARLEN_MAX_BATCHES_1CTA


def round_up(x: int, m: int) -> int:
    """x rounded up to a multiple of m (FA3's batch rounding; the descriptors' token padding)."""
    return (x + m - 1) // m * m


SEMAPHORE = "semaphore"


def effective_causal(
    causal: bool, window_left: int, max_seqlen_q: int, max_seqlen_k: int, head_dim: int, paged: bool
) -> tuple[bool, bool]:
    """(is_causal, is_local) as mha_fwd_get_scheduler_metadata derives them on the host."""
    wl, wr = (window_left, 0) if window_left >= 0 else (-1, -1)
    if causal and wl < 0:
        wr = 0
    if wl >= max_seqlen_k - 1:
        wl = -1
    if wr >= max_seqlen_q - 1:
        wr = -1
    if max_seqlen_q == 1 and wl == -1 and wr == -1:
        if head_dim <= 64 or head_dim > 128 or not paged:
            causal = False
    if causal:
        wr = 0
    is_causal = wl < 0 and wr == 0
    is_local = (wl >= 0 or wr >= 0) and not is_causal
    return is_causal, is_local


@dataclass(frozen=True)
class MetadataLayout:
    flavor: str
    batch: int
    vectors: tuple[str, ...]
    has_semaphore: bool = True

    @property
    def batch_rounded(self) -> int:
        return round_up(self.batch, 4)

    @property
    def size(self) -> int:
        return self.batch_rounded * len(self.vectors) + int(self.has_semaphore)

    @property
    def semaphore_offset(self) -> int:
        return self.batch_rounded * len(self.vectors)

    def offset(self, vector: str) -> int:
        return self.vectors.index(vector) * self.batch_rounded

    def padding_indices(self) -> list[int]:
        """Flat indices FA3 never writes: entries [b, b_r) of every vector."""
        br = self.batch_rounded
        return [v * br + i for v in range(len(self.vectors)) for i in range(self.batch, br)]

    def decode(self, buf: Sequence[int]) -> dict[str, list[int]]:
        """Named fields of a buffer read at THIS layout's offsets (live entries only, plus the semaphore)."""
        vals = [int(x) for x in buf]
        if len(vals) < self.size:
            raise ValueError(f"{self.flavor} layout for b={self.batch} needs {self.size} ints, got {len(vals)}")
        out = {name: vals[self.offset(name) : self.offset(name) + self.batch] for name in self.vectors}
        if self.has_semaphore:
            out[SEMAPHORE] = [vals[self.semaphore_offset]]
        return out

    def describe(self) -> str:
        return f"{self.flavor} b={self.batch} b_r={self.batch_rounded} [{' | '.join(self.vectors)}] size={self.size}"


def metadata_layout(
    flavor: str, batch: int, num_splits: int, is_causal: bool, is_local: bool, arch: int = 90
) -> MetadataLayout:
    """The layout get_scheduler_metadata returns. num_splits is the value the host resolved (heuristic applied)."""
    if flavor == UPSTREAM:
        vecs = ["num_splits_dynamic", "num_m_blocks"]
        if not is_local:
            vecs.append("varlen_batch_idx")
    elif flavor == VLLM:
        vecs = ["prepare_seqlen_q"]
        if batch <= MAX_BATCHES_1CTA and num_splits > 1:
            vecs.append("num_splits_dynamic")
    else:
        raise ValueError(f"unknown FA3 flavor {flavor!r}; expected one of {FLAVORS}")
    if is_causal or is_local:
        vecs.append("num_nheads_in_l2")
    return MetadataLayout(flavor, batch, tuple(vecs), has_semaphore=arch >= 90 or num_splits > 1)


def vllm_buffer_size(max_batch: int) -> int:
    """vLLM's FlashAttentionMetadataBuilder: zeros(1 + round_up(max_batch, 4) * 4)."""
    return 1 + round_up(max_batch, 4) * 4


def layout_from_size(flavor: str, batch: int, size: int, is_causal: bool, is_local: bool) -> MetadataLayout:
    """The layout of a buffer FA3 returned, from its size: with num_splits = 0 only the device-side heuristic
    knows whether the fork's num_splits_dynamic vector is present; the size tells."""
    for splits in (1, 2):
        lay = metadata_layout(flavor, batch, splits, is_causal, is_local)
        if lay.size == size:
            return lay
    raise ValueError(f"no {flavor} layout for b={batch} (causal={is_causal}, local={is_local}) has {size} ints")
