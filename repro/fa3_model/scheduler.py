"""A NumPy/Python model of FA3's get_scheduler_metadata for both builds (upstream flash_attn_3, vLLM's fork).

Host side: causal/local resolution, tile sizes, paged-KV TMA, PackGQA, the split heuristic, the layout.
Device side (prepare_varlen_num_blocks_kernel): m/n blocks, num_splits_dynamic with the kernel's float32
rounding, batch sorting (upstream), heads in L2, the semaphore. Entries FA3 never writes are left as `PAD`.
Checked bit for bit against buffers recorded on an H200 (tests/fixtures/metadata)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from repro.backends.layout import MAX_BATCHES_1CTA, UPSTREAM, VLLM, MetadataLayout, effective_causal, metadata_layout
from repro.backends.scheduler_inputs import SchedulerInputs

PAD = None  # a never-written entry
INT_MIN = -(2**31)
F32 = np.float32


@dataclass(frozen=True)
class HostPlan:
    """What the host derives before launching the prepare kernel; also what a forward launch with the same
    parameters derives (out_accum is sized from num_splits)."""

    is_causal: bool
    is_local: bool
    num_sm: int
    block_m: int
    block_n: int
    pagedkv_tma: bool
    pack_gqa: bool
    num_splits: int
    layout: MetadataLayout


def _round_up_headdim(d: int, flavor: str) -> int:
    # upstream's PyPI build disables hdim 96 (flash_attn_config.py), so 96 rounds up to 128
    for r in (64, 96, 128, 192, 256):
        if r == 96 and flavor == UPSTREAM:
            continue
        if d <= r:
            return r
    return 256


def tile_size_sm90(
    flavor: str, d: int, dv: int, is_causal: bool, is_local: bool, paged_kv_non_tma: bool, one_mma_wg: bool
) -> tuple[int, int]:
    """(kBlockM, kBlockN) for bf16 from tile_size_fwd_sm90 of each build."""
    if d <= 64:
        if dv == 512:
            return 64, 64
        if dv == 256:
            return 128, 96
        if flavor == VLLM:
            if one_mma_wg:
                return 64, 192
            return 192, 128 if is_causal else (160 if is_local or paged_kv_non_tma else 192)
        return 192, 128 if (is_causal or is_local or paged_kv_non_tma) else 192
    if d <= 96:
        return 192, 128 if (is_local or paged_kv_non_tma) else 144
    if d <= 128:
        small_n = is_causal or is_local or paged_kv_non_tma
        if flavor == VLLM:
            return (64, 128 if small_n else 176) if one_mma_wg else (128, 128 if small_n else 160)
        return 128, 128 if small_n else 176
    if d <= 192:
        return 128, 96 if (paged_kv_non_tma or is_local) else (128 if dv <= 128 else (96 if flavor == VLLM else 112))
    return 128, 64 if is_local else 80


def num_splits_heuristic(
    total_mblocks: int,
    num_sms: int,
    num_n_blocks: int,
    num_m_blocks: int,
    size_one_kv_head: int,
    causal_or_local: bool,
    max_splits: int,
) -> int:
    if F32(total_mblocks) >= F32(0.8) * F32(num_sms):
        size_l2 = 50 * 1024 * 1024
        if size_one_kv_head > size_l2 and num_m_blocks >= num_sms * 2 and not causal_or_local:
            return min((size_one_kv_head + size_l2 - 1) // size_l2, max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eff = []
    for s in range(1, max_splits + 1):
        n_waves = F32(total_mblocks * s) / F32(num_sms)
        eff.append(F32(n_waves / F32(math.ceil(n_waves))))
    best = max(eff)
    for s in range(1, max_splits + 1):
        if float(eff[s - 1]) >= 0.85 * float(best):
            return s
    return 1


def host_plan(x: SchedulerInputs) -> HostPlan:
    flavor, h, hk, d = x.flavor, x.num_heads_q, x.num_heads_kv, x.head_dim
    is_causal, is_local = effective_causal(x.causal, x.window_left, x.max_seqlen_q, x.max_seqlen_k, d, True)
    wl, wr = (x.window_left, 0) if x.window_left >= 0 else (-1, -1)
    if wl >= x.max_seqlen_k - 1:
        wl = -1
    if wr >= x.max_seqlen_q - 1:
        wr = -1
    if is_causal:
        wr = 0
    if flavor == UPSTREAM:
        wl = x.max_seqlen_k - 1 if wl < 0 else wl
        wr = x.max_seqlen_q - 1 if wr < 0 else wr
    else:
        if wl < 0 <= wr:
            wl = x.max_seqlen_k - 1
        if wl >= 0 > wr:
            wr = x.max_seqlen_q - 1
    num_sm = x.num_sms - x.sm_margin
    dr = _round_up_headdim(d, flavor)
    one_wg = flavor == VLLM and d in (64, 128) and not is_local and x.max_seqlen_q * (h // hk) <= 64
    group = h // hk
    # paged KV through TMA?
    bm0, bn0 = tile_size_sm90(flavor, dr, dr, is_causal, is_local, False, one_wg)
    tma = not (flavor == VLLM and is_local) and x.page_size % bn0 == 0 and x.max_seqlen_q * group > bm0
    bm, bn = tile_size_sm90(flavor, dr, dr, is_causal, is_local, not tma, one_wg)
    if x.num_splits <= 0:
        loaded = x.max_seqlen_k if not is_local else max(0, min(x.max_seqlen_k, wr + wl + 1 + bm))
        n_blocks = (loaded + bn - 1) // bn
        m_blocks = (x.max_seqlen_q * group + bm - 1) // bm
        size_one = x.max_seqlen_k * (d + d) * 2
        splits = num_splits_heuristic(hk * m_blocks, num_sm, n_blocks, m_blocks, size_one, is_causal or is_local, 128)
    else:
        splits = x.num_splits
    pack = True if (not tma) or splits > 1 else _pack_gqa(flavor, h, hk, d, is_local, x.max_seqlen_q, bm)
    if flavor == VLLM:
        pack = pack or splits > 1
    layout = metadata_layout(flavor, x.batch, splits, is_causal, is_local)
    return HostPlan(is_causal, is_local, num_sm, bm, bn, tma, pack, splits, layout)


def _pack_gqa(flavor: str, h: int, hk: int, d: int, is_local: bool, seqlen_q: int, bm: int) -> bool:
    if flavor == VLLM and h // hk == 8 and is_local and d == 64:
        return True
    if h == hk:
        return False
    return True  # varlen q (cu_seqlens_q given): should_pack_gqa returns True


def scheduler_metadata(x: SchedulerInputs) -> tuple[list[int | None], HostPlan]:
    """The int32 buffer FA3 returns (PAD where it writes nothing) and the host plan behind it."""
    plan = host_plan(x)
    lay = plan.layout
    b, group = x.batch, -(-x.num_heads_q // x.num_heads_kv)
    heads = x.num_heads_kv if plan.pack_gqa else x.num_heads_q
    bm, bn = plan.block_m, plan.block_n
    qlens = [x.query_start_loc[i + 1] - x.query_start_loc[i] for i in range(b)]
    m_blocks = [-(-(q * (group if plan.pack_gqa else 1)) // bm) for q in qlens]
    n_blocks = [-(-max(0, k) // bn) for k in x.seq_lens]
    if x.flavor == UPSTREAM:
        l2 = 8 * 1024 * 1024
    else:
        div = 1 if group == 1 else 2 if group <= 2 else 4 if group <= 4 else 8 if group <= 8 else 16
        l2 = (32 * 1024 * 1024) // div
    max_kv_l2 = l2 // (bn * (x.head_dim + x.head_dim) * 2)

    def nheads_l2(nb: int) -> int:
        n = next((k for k in (16, 8, 4, 2) if nb * k <= max_kv_l2), 1)
        if not plan.pack_gqa:
            n *= group
        return min(n, heads)

    nsd = [1] * b
    nb_split = list(n_blocks)
    if b <= MAX_BATCHES_1CTA and plan.num_splits != 1:
        total = sum(m * n for m, n in zip(m_blocks, n_blocks))
        bps = int(math.ceil(F32(F32(F32(total) * F32(1.1)) * F32(heads)) / F32(plan.num_sm)))
        for i in range(b):
            if bps <= 0:
                raise ZeroDivisionError("every batch is empty: the kernel divides by zero blocks per SM")
            nsd[i] = max(min((n_blocks[i] + bps - 1) // bps, plan.num_splits), 1)
            nb_split[i] = -(-n_blocks[i] // nsd[i])
    buf: list[int | None] = [PAD] * lay.size
    if lay.has_semaphore:
        buf[lay.semaphore_offset] = 0

    def put(name: str, i: int, v: int) -> None:
        if name in lay.vectors:
            buf[lay.offset(name) + i] = v

    if "varlen_batch_idx" in lay.vectors:  # upstream, sorted by work (descending, stable), per CTA of 992
        keys = []
        for i in range(b):
            k = nb_split[i]
            if plan.is_causal:
                k = nb_split[i] * bn - m_blocks[i] * bm
            keys.append(k)
        for start in range(0, b, MAX_BATCHES_1CTA):
            idx = sorted(range(start, min(b, start + MAX_BATCHES_1CTA)), key=lambda i: -keys[i])
            for v, i in enumerate(idx, start):
                xk = keys[i]
                if plan.is_causal:
                    xk = (xk + m_blocks[i] * bm) // bn
                put("num_nheads_in_l2", v, nheads_l2(max(xk, 1)))
                put("num_m_blocks", v, m_blocks[i])
                put("num_splits_dynamic", v, nsd[i])
                put("varlen_batch_idx", v, i)
    else:
        for i in range(b):
            put("num_nheads_in_l2", i, nheads_l2(max(nb_split[i], 1)))
            put("num_splits_dynamic", i, nsd[i])
            put("num_m_blocks", i, m_blocks[i])
            put("prepare_seqlen_q", i, qlens[i] * (group if plan.pack_gqa else 1))
    return buf, plan
