"""The eagle layout's releases on the H200 after the auditor learnt the draft loop's own slot updates
(results/h200-eagle-0.20.2-0.22.0: 0.20.2 and 0.22.0 with --no-control, audit and plain), judged again on a CPU from
their records: 0.20.2 clean (its loop's seq_lens advances and slot recomputes are not staleness), 0.22.0 stale in its
draft prefill captures, so the affected range starts after 0.20.2, measured."""

from __future__ import annotations

import json

from repro.exit_codes import gate as gate_exit
from repro.vllm_integration.gate.report import to_json
from tests.recorded_gate import replay
from tests.records import RESULTS

RECORD = RESULTS / "h200-eagle-0.20.2-0.22.0"
V = "stale_metadata-vllm-"


def test_0202_is_clean_and_0220_is_stale_in_its_draft_prefill_captures(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RECORD)
    assert {k: r.verdict for k, r in got.items()} == {k: row["verdict"] for k, row in rows.items()}
    assert got[f"{V}0.20.2-under-test-audit"].verdict == got[f"{V}0.20.2-under-test-plain"].verdict == "clean"
    stale = got[f"{V}0.22.0-under-test-audit"]
    assert stale.verdict == "stale-audit" and stale.descriptor
    audit = json.loads((RECORD / "logs" / f"{V}0.22.0-under-test-audit.audit.json").read_text())
    assert audit["mismatches"] and all(m["buffer"] != "slot_mapping" for m in audit["mismatches"])
    clean = json.loads((RECORD / "logs" / f"{V}0.20.2-under-test-audit.audit.json").read_text())
    assert clean["checks"] > 500 and not clean["mismatches"]
    assert run.outcome(need_control=False) == doc["outcome"] == "AFFECTED" and gate_exit(run.outcome(False)) == 1
    # the GPU's answer per release again (the source check needs the builds' files, which the record does not hold)
    run.judge(need_control=False)
    again = to_json(run, doc["environment"])["release_range"]
    assert [(r["build"], r["gpu"]) for r in again["releases"]] == [("0.20.2", "good"), ("0.22.0", "bad")]
    assert [(r["build"], r["source"]) for r in doc["release_range"]["releases"]] == [
        ("0.20.2", "good"),
        ("0.22.0", "bad"),
    ]
    assert doc["release_range"]["transitions"] == ["introduced: last good 0.20.2, first bad 0.22.0"]
