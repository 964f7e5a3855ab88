"""Strategy semantics: under stale, the draft pass for descriptor D gets views whose buffers hold another
descriptor's build; under fresh, never."""

import pytest

from repro.attention.builder import MetadataBuilder
from repro.attention.staleness import diff_snapshots
from repro.case.descriptors import AttnConfig, full_decode_descriptors
from repro.case.scenarios import CAPTURE, FRESH, STALE, WARMUP, pair_sequence, passes_for, v2_capture_sequence
from repro.errors import ConfigError

CFG = AttnConfig()


def _holder(builder):
    return builder.last_build[1]


def test_v2_stale_views_hold_the_targets_last_build(replay):
    b = MetadataBuilder(replay, CFG)
    shadow = MetadataBuilder(replay, CFG)
    descs = full_decode_descriptors(CFG)
    stale_passes = 0
    for p in v2_capture_sequence(b, STALE):
        assert _holder(b) == descs[-1]  # the target's smallest FULL descriptor, built last
        diffs = diff_snapshots(p.metadata, p.metadata.snapshot(), shadow.build(p.descriptor).snapshot())
        if p.descriptor != descs[-1]:
            assert diffs, p.descriptor
            stale_passes += 1
        else:
            assert not diffs
    assert stale_passes == 2 * (len(descs) - 1)


def test_v2_fresh_views_always_hold_their_own_build(replay):
    b = MetadataBuilder(replay, CFG)
    shadow = MetadataBuilder(replay, CFG)
    stages = []
    for p in v2_capture_sequence(b, FRESH):
        assert _holder(b) == p.descriptor
        assert p.metadata.build_id == b.last_build[0]
        assert diff_snapshots(p.metadata, p.metadata.snapshot(), shadow.build(p.descriptor).snapshot()) == []
        stages.append(p.stage)
    assert stages[:2] == [WARMUP, CAPTURE]


def test_v2_order_and_build_count(replay):
    b = MetadataBuilder(replay, CFG)
    descs = full_decode_descriptors(CFG)
    seen = [(p.descriptor, p.stage) for p in v2_capture_sequence(b, STALE)]
    assert seen == [(d, s) for d in descs for s in (WARMUP, CAPTURE)]
    assert len(b.builds) == 2 * len(descs)  # the target's warmup + capture builds only


def test_pair_stale_and_fresh(replay):
    from repro.case.descriptors import BatchDescriptor

    a, l_ = BatchDescriptor(4, 1, 4), BatchDescriptor(32, 8, 4)
    b = MetadataBuilder(replay, CFG)
    stale = list(pair_sequence(b, STALE, a, l_))
    assert all(p.descriptor == l_ for p in stale) and _holder(b) == a
    b2 = MetadataBuilder(replay, CFG)
    fresh = list(pair_sequence(b2, FRESH, a, l_))
    assert _holder(b2) == l_ and fresh[-1].metadata.build_id == b2.last_build[0]


def test_bad_scenario_and_strategy(replay):
    b = MetadataBuilder(replay, CFG)
    with pytest.raises(ConfigError):
        list(passes_for("nope", b, STALE))
    with pytest.raises(ConfigError):
        list(passes_for("v2-capture", b, "sometimes"))
    with pytest.raises(ConfigError, match="built-for"):
        list(passes_for("pair", b, STALE))


def test_the_matrix_pair_scenario_runs_with_its_descriptors():
    """`matrix --scenario pair` gives every case the default descriptor pair (or the one named), so the worker's
    passes build; each case used to error on a missing --built-for/--launched."""
    from repro.case.matrix import MatrixOptions, build_specs
    from repro.case.scenarios import DEFAULT_PAIR
    from repro.case.spec import CaseSpec
    from repro.fa3_model.predict import ModelBackend

    specs = build_specs(MatrixOptions(scenario="pair", sms=("full",), modes=("eager",), splits=(32,)))
    assert len(specs) == 4 and all(s.pair == DEFAULT_PAIR for s in specs)
    for s in specs:
        b = MetadataBuilder(ModelBackend(s.backend), s.cfg)
        passes = list(passes_for(s.scenario, b, s.strategy, s.pair))
        assert [(p.descriptor.label, p.stage) for p in passes] == [("t32r8", WARMUP), ("t32r8", CAPTURE)]
        assert (b.last_build[1].label == "t4r1") == (s.strategy == STALE)  # stale: the buffers hold t4r1's build
    named = build_specs(MatrixOptions(scenario="pair", pair=("t8r2", "t16r4")))
    assert all(s.pair == ("t8r2", "t16r4") and s.case_id.count("pair-t8r2-t16r4") == 1 for s in named)
    for bad, match in (
        (MatrixOptions(scenario="pair", pair=("t4r1", "t400r100")), "over the max batch"),
        (MatrixOptions(scenario="pair", pair=("t4r1", "tXr")), "bad descriptor"),
        (MatrixOptions(pair=("t4r1", "t32r8")), "describe the pair scenario"),
    ):
        with pytest.raises(ConfigError, match=match):
            build_specs(bad)
    with pytest.raises(ConfigError, match="built-for"):  # no pair case without its descriptors, wherever it is made
        CaseSpec("vllm", STALE, scenario="pair")
