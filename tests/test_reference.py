"""The tolerance rule of the attention-layer cases: FlashAttention's (twice the low-precision reference's error)."""

import torch

from repro.attention.reference import ATOL, paged_attention_reference, tolerance


def _batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(8, 4, 64, generator=g).bfloat16()
    k = torch.randn(6, 16, 2, 64, generator=g).bfloat16()
    v = torch.randn(6, 16, 2, 64, generator=g).bfloat16()
    table = torch.arange(6).reshape(2, 3)
    return q, k, v, [0, 4, 8], [40, 33], table


def test_tolerance_is_relative_to_the_low_precision_reference():
    args = _batch()
    ref = paged_attention_reference(*args, True)
    lowp = paged_attention_reference(*args, True, upcast=False)
    tol = tolerance(ref, lowp)
    assert ATOL < tol < 0.2  # bf16 arithmetic is off by a measurable, small amount
    rounded = ref.bfloat16().float()  # what a correct bf16 kernel can return
    assert float((rounded - ref).abs().max()) <= tol
    garbage = ref.clone()
    garbage[5] += 0.5  # one token's output from another batch's metadata
    assert float((garbage - ref).abs().max()) > tol
