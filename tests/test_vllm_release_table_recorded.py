"""The release table on the H200 (results/h200-release-table-2: 0.20.2, 0.26.0, 0.25.1 as the known-bad control,
0.33.0 on torch 2.14 and its source mutant, each build under test with its self control, in one command), judged
again on a CPU from its records, and the auditor's rule for the eagle draft loop checked against what 0.20.2's
captures held there."""

from __future__ import annotations

import json

from repro.exit_codes import gate as gate_exit
from repro.vllm_integration.plugin.audit import _slots_advanced
from tests.recorded_gate import replay
from tests.records import RESULTS

RECORD = RESULTS / "h200-release-table-2"
V = "stale_metadata-vllm-"


def _mismatches(case: str) -> list[dict]:
    return json.loads((RECORD / "logs" / f"{V}{case}.audit.json").read_text())["mismatches"]


def test_every_recorded_verdict_comes_back_and_the_run_is_affected_by_the_mutant(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RECORD)
    assert {k: (r.verdict, r.kernel) for k, r in got.items()} == {
        k: (row["verdict"], row["result"]["kernel"]) for k, row in rows.items()
    }
    verdicts = {k: r.verdict for k, r in got.items()}
    for b in ("0.26.0", "0.33.0"):  # the fixed releases: clean; their self controls crash in both modes
        assert [verdicts[f"{V}{b}-under-test-{m}"] for m in ("audit", "plain")] == ["clean", "clean"]
        assert [verdicts[f"{V}{b}-self-control-{m}"] for m in ("audit", "plain")] == ["crash", "crash"]
    assert [verdicts[f"{V}0.33.0-mutant-under-test-{m}"] for m in ("audit", "plain")] == ["wrong-output"] * 2
    # 0.25.1 as it is: caught by its audit, silent in plain (policy rule 5: a listed miss)
    assert [verdicts[f"{V}0.25.1-control-{m}"] for m in ("audit", "plain")] == ["stale-audit", "clean"]
    assert run.outcome() == doc["outcome"] == "AFFECTED" and gate_exit(run.outcome()) == 1
    assert run.decision().misses == [f"{V}0.25.1-control-plain: clean (detected in audit)"]


def test_0202s_recorded_stale_views_were_all_its_draft_loops_own_slot_updates():
    """0.20.2 (sources good) came back stale-audit: 100 mismatches, every one a slot_mapping view of a draft decode
    capture whose seq_lens the same check saw advanced by one (100 loop advances). Under the auditor's rule for the
    loop's slots (`_slots_advanced`, added after this run) every recorded entry is the loop's own; its self control's
    stale views (another descriptor's query_start_loc, seq_lens and scheduler metadata) are not."""
    under = _mismatches("0.20.2-under-test-audit")
    assert len(under) == 100 and {m["buffer"] for m in under} == {"slot_mapping"}
    assert all(_slots_advanced([m["built"]], [m["now"]], 1) for m in under)
    injected = [m for m in _mismatches("0.20.2-self-control-audit") if m["buffer"] != "slot_mapping"]
    assert {m["buffer"] for m in injected} == {"scheduler_metadata", "query_start_loc", "seq_lens"}
    assert len(injected) == 534
