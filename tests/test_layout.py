"""Layouts checked against every buffer FA3 returned on the H200 (both builds, 636 calls each)."""

import pytest

from repro.backends.layout import (
    UPSTREAM,
    VLLM,
    effective_causal,
    layout_from_size,
    metadata_layout,
    vllm_buffer_size,
)
from repro.backends.replay import load_records


@pytest.mark.parametrize("name", ["vllm-0.25.1", "upstream"])
def test_layout_module_matches_every_recorded_buffer(fixtures, name):
    header, records = load_records(fixtures / "metadata" / f"h200-{name}.jsonl.gz")
    assert len(records) >= 600
    for r in records:
        is_causal, is_local = effective_causal(
            r["causal"], r["window_left"], r["max_seqlen_q"], r["max_seqlen_k"], r["head_dim"], True
        )
        lay = layout_from_size(header["backend"]["name"], r["batch"], len(r["metadata"]), is_causal, is_local)
        assert list(lay.vectors) == r["vectors"], r
        # the semaphore is zeroed by the prepare kernel
        assert r["metadata"][lay.semaphore_offset] == 0


def test_recorded_upstream_batch_idx_is_a_permutation(fixtures):
    _, records = load_records(fixtures / "metadata" / "h200-upstream.jsonl.gz")
    checked = 0
    for r in records:
        if "varlen_batch_idx" in r["vectors"]:
            lay = metadata_layout(UPSTREAM, r["batch"], r["num_splits"] or 2, "num_nheads_in_l2" in r["vectors"], False)
            idx = lay.decode(r["metadata"])["varlen_batch_idx"]
            assert sorted(idx) == list(range(r["batch"]))
            checked += 1
    assert checked > 100


def test_vllm_num_splits_dynamic_bounded_by_static_splits(fixtures):
    _, records = load_records(fixtures / "metadata" / "h200-vllm-0.25.1.jsonl.gz")
    seen = 0
    for r in records:
        if "num_splits_dynamic" in r["vectors"] and r["num_splits"] > 0:
            lay = metadata_layout(VLLM, r["batch"], r["num_splits"], "num_nheads_in_l2" in r["vectors"], False)
            nsd = lay.decode(r["metadata"])["num_splits_dynamic"]
            assert all(1 <= x <= r["num_splits"] for x in nsd)
            seen += 1
    assert seen > 50


def test_vllm_layout_depends_on_splits_and_causal():
    assert metadata_layout(VLLM, 8, 32, True, False).vectors == (
        "prepare_seqlen_q",
        "num_splits_dynamic",
        "num_nheads_in_l2",
    )
    assert metadata_layout(VLLM, 8, 1, False, False).vectors == ("prepare_seqlen_q",)
    assert metadata_layout(VLLM, 1000, 32, False, False).vectors == ("prepare_seqlen_q",)  # b > 992
    assert metadata_layout(VLLM, 5, 32, True, False).size == 8 * 3 + 1


def test_upstream_layout_local_drops_sorting():
    assert metadata_layout(UPSTREAM, 4, 2, False, True).vectors == (
        "num_splits_dynamic",
        "num_m_blocks",
        "num_nheads_in_l2",
    )
    assert metadata_layout(UPSTREAM, 4, 2, True, False).vectors == (
        "num_splits_dynamic",
        "num_m_blocks",
        "varlen_batch_idx",
        "num_nheads_in_l2",
    )


def test_padding_indices_and_decode():
    lay = metadata_layout(VLLM, 5, 32, True, False)
    assert lay.batch_rounded == 8
    assert lay.padding_indices() == [5, 6, 7, 13, 14, 15, 21, 22, 23]
    buf = list(range(lay.size))
    dec = lay.decode(buf)
    assert dec["num_splits_dynamic"] == [8, 9, 10, 11, 12]
    assert dec["semaphore"] == [24]
    with pytest.raises(ValueError):
        lay.decode(buf[:-1])


def test_effective_causal_decode_special_case():
    # q_len 1 turns causal off for hdim 256 (FA3's host logic) but not for hdim 128 with a paged cache
    assert effective_causal(True, -1, 1, 4096, 256, True) == (False, False)
    assert effective_causal(True, -1, 1, 4096, 128, True) == (True, False)
    assert effective_causal(True, -1, 4, 4096, 256, True) == (True, False)
    assert effective_causal(False, 128, 4, 4096, 128, True) == (False, True)


def test_vllm_buffer_size():
    assert vllm_buffer_size(64) == 257
    assert vllm_buffer_size(5) == 33


def test_unknown_flavor():
    with pytest.raises(ValueError):
        metadata_layout("nope", 1, 1, False, False)
    with pytest.raises(ValueError):
        layout_from_size(VLLM, 4, 7, True, False)
