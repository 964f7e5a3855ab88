"""Builder and views on CPU tensors, with FA3's real answers replayed from the H200 recordings."""

import pytest
import torch

from repro.attention.builder import MetadataBuilder
from repro.attention.staleness import diff_snapshots, summarize
from repro.case.descriptors import AttnConfig, BatchDescriptor, full_decode_descriptors
from repro.case.poison import INT32_MAX, parse_poison
from repro.errors import ConfigError

CFG = AttnConfig()  # the default matrix's shape: recorded at sm_margin 0 and 116


def test_build_writes_persistent_buffers_and_returns_views(replay):
    b = MetadataBuilder(replay, CFG)
    d = BatchDescriptor(32, 8, 4)
    md = b.build(d)
    assert md.scheduler_metadata.data_ptr() == b.scheduler_metadata.data_ptr()
    assert md.query_start_loc.data_ptr() == b.query_start_loc.data_ptr()
    assert md.query_start_loc.tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 32]
    assert md.seq_lens.tolist() == [4] * 8
    assert b.query_start_loc[9:].eq(32).all()  # padded with num_tokens
    assert b.seq_lens[8:].eq(0).all()
    n = md.layout.size
    assert md.scheduler_metadata.numel() == n
    assert b.scheduler_metadata[n:].eq(0).all()  # tail zeroed as vLLM does


def test_saved_view_shows_the_latest_build(replay):
    b = MetadataBuilder(replay, CFG)
    big, small = BatchDescriptor(64, 16, 4), BatchDescriptor(4, 1, 4)
    saved = b.build(big)
    before = saved.snapshot()
    b.build(small)
    after = saved.snapshot()
    assert before != after
    assert after["query_start_loc"][:3] == [0, 4, 4]  # one request of 4 tokens, padded with 4
    assert after["seq_lens"] == [4] + [0] * 15


def test_stale_diff_names_fields_and_fresh_diff_is_empty(replay):
    b, shadow = MetadataBuilder(replay, CFG), MetadataBuilder(replay, CFG)
    d = BatchDescriptor(32, 8, 4)
    saved = b.build(d)
    b.build(BatchDescriptor(4, 1, 4))
    fresh = shadow.build(d)
    diffs = diff_snapshots(saved, saved.snapshot(), fresh.snapshot())
    counts = summarize(diffs)
    assert counts["query_start_loc"] == 7 and counts["seq_lens"] == 7
    assert any(k.startswith("scheduler_metadata.") for k in counts)
    assert str(diffs[0]).startswith("query_start_loc.query_start_loc[2]: 4 (fresh 8)")
    again = b.build(d)
    assert diff_snapshots(again, again.snapshot(), fresh.snapshot()) == []


def test_poison_fills_only_never_written_entries(replay):
    plain = MetadataBuilder(replay, CFG)
    poisoned = MetadataBuilder(replay, CFG, poison=parse_poison("int-max"))
    d = BatchDescriptor(24, 6, 4)  # b=6, b_r=8: 2 padding entries per vector
    a, p = plain.build(d), poisoned.build(d)
    assert p.poisoned_entries == 2 * len(p.layout.vectors)
    pad = set(p.layout.padding_indices())
    av, pv = a.scheduler_metadata.tolist(), p.scheduler_metadata.tolist()
    for i in range(len(av)):
        if i in pad:
            assert pv[i] == INT32_MAX
        else:
            assert pv[i] == av[i]


def test_dummy_batches_never_split(replay):
    """make_dummy gives seq_len = query_len, one KV block: a FRESH build asks for one split at any SM count, so any
    other num_splits_dynamic a capture sees came from somewhere else."""
    for margin in (0, replay.sms - 16):
        b = MetadataBuilder(replay, CFG.with_(num_splits=0), sm_margin=margin)
        for d in full_decode_descriptors(CFG):
            md = b.build(d)
            dec = md.layout.decode(md.scheduler_metadata.tolist())
            assert dec["num_splits_dynamic"] == [1] * d.num_reqs


def test_every_default_descriptor_is_recorded(replay):
    for splits in (32, 0):
        cfg = CFG.with_(num_splits=splits)
        for margin in (0, replay.sms - 16):
            b = MetadataBuilder(replay, cfg, sm_margin=margin)
            for d in full_decode_descriptors(cfg):
                assert b.build(d).layout.batch == d.num_reqs


def test_over_capacity_descriptor_is_rejected(replay):
    b = MetadataBuilder(replay, CFG)
    with pytest.raises(ConfigError, match="over max batch"):
        b.build(BatchDescriptor(4 * 100, 100, 4))


def test_unrecorded_call_is_a_clear_error(replay):
    b = MetadataBuilder(replay, CFG.with_(num_heads_q=48))
    with pytest.raises(KeyError, match="no recorded metadata"):
        b.build(BatchDescriptor(4, 1, 4))


def test_launch_passes_the_builds_views_and_host_parameters(replay):
    """AttnMetadata.launch is the one FA3 forward call (worker and models); check what reaches the backend."""
    b = MetadataBuilder(replay, CFG)
    md = b.build(BatchDescriptor(32, 8, 4))
    seen = {}

    class Recorder:
        def forward(self, q, k, v, **kw):
            seen.update(kw, q=q)

    q = torch.zeros(32, 32, 128)
    md.launch(Recorder(), q, None, None, "out", 116)
    assert seen["q"] is q and seen["out"] == "out" and seen["sm_margin"] == 116
    assert seen["scheduler_metadata"].data_ptr() == b.scheduler_metadata.data_ptr()
    assert seen["cu_seqlens_q"].data_ptr() == b.query_start_loc.data_ptr()
    assert (seen["max_seqlen_q"], seen["max_seqlen_k"], seen["num_splits"], seen["causal"]) == (4, 4096, 32, True)
    assert seen["window"] == (-1, -1) and seen["block_table"].shape == (8, CFG.max_blocks_per_seq)
    # the request is a copy: a later build does not rewrite what this build was asked for
    b.build(BatchDescriptor(4, 1, 4))
    assert md.request["cu_seqlens_q"].tolist() == [0, 4, 8, 12, 16, 20, 24, 28, 32]
