"""Plain-PyTorch paged attention: the right answer for a batch, to call FA3's output wrong."""

from __future__ import annotations

from typing import Any


def paged_attention_reference(
    q: Any,
    k_cache: Any,
    v_cache: Any,
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: Any,
    causal: bool,
    window_left: int = -1,
    upcast: bool = True,
) -> Any:
    """q [T, Hq, d]; caches [pages, page, Hkv, d]. Causal is aligned bottom-right as FA3 does. Returns fp32 [T, Hq, d].
    upcast=False computes in the inputs' own precision (bf16): the low-precision reference whose error against the
    fp32 one sets the tolerance (tolerance())."""
    import torch  # torch only when tensors are made: the module loads without it

    dt = torch.float32 if upcast else q.dtype
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    page = k_cache.shape[1]
    group = q.shape[1] // k_cache.shape[2]
    scale = q.shape[-1] ** -0.5
    for i, L in enumerate(seq_lens):
        s, e = query_start_loc[i], query_start_loc[i + 1]
        if e <= s or L <= 0:
            continue
        pages = block_table[i, : -(-L // page)].long()
        k = k_cache[pages].reshape(-1, *k_cache.shape[2:])[:L].to(dt).repeat_interleave(group, dim=1)
        v = v_cache[pages].reshape(-1, *v_cache.shape[2:])[:L].to(dt).repeat_interleave(group, dim=1)
        qi = q[s:e].to(dt) * scale
        scores = torch.einsum("qhd,khd->hqk", qi, k)
        ql = e - s
        qpos = torch.arange(ql, device=q.device)[:, None] + (L - ql)
        kpos = torch.arange(L, device=q.device)[None, :]
        mask = torch.zeros(ql, L, dtype=torch.bool, device=q.device)
        if causal:
            mask |= kpos > qpos
        if window_left >= 0:
            mask |= kpos < qpos - window_left
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[s:e] = torch.einsum("hqk,khd->qhd", probs, v).float()
    return out


ATOL = 1e-3


def tolerance(ref: Any, ref_lowp: Any) -> float:
    """FlashAttention's rule: the kernel may be off the fp32 reference by twice the error of a plain low-precision
    reference, plus a small absolute slack."""
    return 2.0 * float((ref_lowp - ref).abs().max()) + ATOL
