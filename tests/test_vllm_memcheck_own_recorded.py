"""memcheck with an allocator of its own (gate mode memcheck:own, repro.run.own_alloc) on the H200, judged again on a
CPU from its records (results/h200-memcheck-own-nofill, -fill, -gate): memcheck sees inside real vLLM now. 0.26.0 has
0 findings; its self control is an out-of-bounds read named in FA3's forward kernel, with the allocation it missed;
0.25.1 decodes without a finding (with or without the fill) and the gate says so (rule 5 beside audit and plain, HARNESS
BLIND alone)."""

from __future__ import annotations

import pytest

from tests.recorded_gate import replay
from tests.records import RESULTS

V = "stale_metadata-vllm-"
MODE = "compile-none-memcheck-own"


@pytest.mark.parametrize("record", ["h200-memcheck-own-nofill", "h200-memcheck-own-fill", "h200-memcheck-own-gate"])
def test_the_memcheck_own_records_replay_to_their_verdicts(monkeypatch, tmp_path, record):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / record)
    assert {k: r.verdict for k, r in got.items()} == {k: row["verdict"] for k, row in rows.items()}
    assert run.outcome() == doc["outcome"]
    assert got[f"{V}0.26.0-under-test-{MODE}"].verdict == "clean"
    caught = got[f"{V}0.26.0-self-control-{MODE}"]
    assert caught.verdict == "oob" and "main kernel FlashAttnFwdSm90" in caught.reason
    assert " bytes before a " in caught.reason or " bytes after a " in caught.reason  # the allocation it overran
    # its output ends in the speculator's (the draft's) prefill capture
    assert "Capturing prefill CUDA graphs" in repr(caught)
    assert got[f"{V}0.25.1-control-{MODE}"].verdict == "clean"


def test_alone_the_mode_that_misses_the_known_bad_build_is_harness_blind_beside_others_rule_5(monkeypatch, tmp_path):
    alone = replay(monkeypatch, tmp_path / "a", RESULTS / "h200-memcheck-own-fill")[2]
    assert alone.outcome() == "HARNESS BLIND"
    beside = replay(monkeypatch, tmp_path / "b", RESULTS / "h200-memcheck-own-gate")[2]
    assert beside.outcome() == "PASS"
