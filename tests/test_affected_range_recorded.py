"""The affected range across vLLM releases, judged again on a CPU from the H200 records: it starts at 0.21.0
measured alone (results/h200-eagle-0.20.2-0.21.0-alone), the eagle-layout self control faults once the injection
hands over the object too, five releases run cold on the fast path, and overlays lacking their dist-info cannot be
vouched for."""

from __future__ import annotations

import json

from repro.exit_codes import gate as gate_exit
from repro.vllm_integration.gate.report import to_json
from tests.recorded_gate import FAULTS, replay, replayed, same_verdicts
from tests.records import RESULTS

V = "stale_metadata-vllm-"


def test_the_affected_range_starts_at_0210_measured_alone(monkeypatch, tmp_path):
    record = RESULTS / "h200-eagle-0.20.2-0.21.0-alone"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    same_verdicts(got, rows, run)
    assert got[f"{V}0.20.2-under-test-audit"].verdict == got[f"{V}0.20.2-under-test-plain"].verdict == "clean"
    assert {got[f"{V}0.20.2-self-control-{m}"].verdict for m in ("audit", "plain")} <= set(FAULTS)
    stale = got[f"{V}0.21.0-under-test-audit"]
    assert stale.verdict == "stale-audit" and stale.descriptor
    audit = json.loads((record / "logs" / f"{V}0.21.0-under-test-audit.audit.json").read_text())
    assert audit["mismatches"] and all(m["buffer"] != "slot_mapping" for m in audit["mismatches"])
    clean = json.loads((record / "logs" / f"{V}0.20.2-under-test-audit.audit.json").read_text())
    assert clean["checks"] > 500 and not clean["mismatches"]
    # 0.21.0's self control: a silently wrong draft, judged by the draft's acceptance against its reference; its second
    # attempt repeated it and a third never ran (gate.process.run_control compares a clean attempt once the reference
    # finished)
    for m in ("audit", "plain"):
        wrong = got[f"{V}0.21.0-self-control-{m}"]
        assert wrong.verdict == "wrong-output" and "draft is silently wrong" in wrong.reason
    assert [k for k in rows if "attempt" in k] == [f"{V}0.21.0-self-control-plain-attempt2"]
    assert run.outcome(need_control=False) == doc["outcome"] == "AFFECTED" and gate_exit(run.outcome(False)) == 1
    run.judge(need_control=False)
    again = to_json(run, doc["environment"])["release_range"]
    assert [(r["build"], r["gpu"]) for r in again["releases"]] == [("0.20.2", "good"), ("0.21.0", "bad")]
    assert (
        again["transitions"]
        == doc["release_range"]["transitions"]
        == ["introduced: last good 0.20.2, first bad 0.21.0"]
    )


def test_the_eagle_self_control_faults_with_the_object_handed_over(monkeypatch, tmp_path):
    """0.20-0.22 build a draft capture's metadata once per descriptor for both passes; before, the injection could not
    place such a build and wrote the buffers alone: 0.20.2's self control decoded cleanly in plain (HARNESS BLIND).
    Handed the first descriptor's metadata too, it faults in audit and plain, in the combine kernel."""
    before = replayed(monkeypatch, tmp_path / "before", "h200-release-table-2")[3]
    assert before[f"{V}0.20.2-self-control-plain"].verdict == "clean"
    old = RESULTS / "h200-release-table-2" / "logs" / f"{V}0.20.2-self-control-audit.audit.json"
    assert json.loads(old.read_text())["counters"]["inject_reuse_unplaced"] == 147
    doc, rows, run, got = replayed(monkeypatch, tmp_path / "after", "h200-eagle-0.20.2-0.21.0")
    plain = got[f"{V}0.20.2-self-control-plain"]
    assert plain.verdict == "crash" and plain.kernel == "combine"
    assert got[f"{V}0.20.2-self-control-audit"].verdict == "crash"
    for release in ("0.20.2", "0.21.0"):
        audit = json.loads(
            (RESULTS / "h200-eagle-0.20.2-0.21.0" / "logs" / f"{V}{release}-self-control-audit.audit.json").read_text()
        )
        c = audit["counters"]
        assert c["spec_layout"] == "eagle" and c["inject_reused"]["both"] > 0 and "inject_reuse_unplaced" not in c
        assert c["captures_injected"]["draft prefill"] == 49
    # 0.21.0's self control: its draft silently wrong (a third of the draft tokens accepted, all of them without graphs)
    assert got[f"{V}0.21.0-self-control-plain"].verdict == "wrong-output"
    assert "32 of 96 draft tokens accepted" in got[f"{V}0.21.0-self-control-plain"].reason
    # 0.21.0 itself hung in the draft's prefill captures (its stall watch; five gates ran on the GPU at once): bad
    assert got[f"{V}0.21.0-under-test-plain"].verdict == "hang"
    assert run.outcome() == doc["outcome"] == "AFFECTED"


def test_five_releases_cold_on_the_fast_path_under_two_minutes(monkeypatch, tmp_path):
    record = RESULTS / "h200-release-sweep-fast-2"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    same_verdicts(got, rows)
    again = to_json(run, doc["environment"])["release_range"]
    assert [(r["build"], r["gpu"]) for r in again["releases"]] == [
        ("0.23.0", "bad"),
        ("0.24.0", "bad"),
        ("0.25.0", "bad"),
        ("0.25.1", "bad"),
        ("0.26.0", "good"),
    ]
    assert doc["release_range"]["transitions"] == ["fixed: last bad 0.25.1, first good 0.26.0"]
    assert all(r["source"] == r["gpu"] for r in doc["release_range"]["releases"])  # the source check agrees
    assert all(row["verdict"] == "clean" for k, row in rows.items() if "reference" in k)
    # the gate's own figure and the command's wall (command.txt: its start to its exit), both cold
    wall = int((record / "command.txt").read_text().split("# exit 1, ")[1].split(" s wall")[0])
    assert doc["wall_s"] < wall < 120


def test_a_sweep_whose_overlays_lack_their_dist_info_cannot_vouch_for_them(monkeypatch, tmp_path):
    """0.24.0's and 0.25.0's vllm/ without a dist-info (fixed since: Overlay.make writes one): vLLM found no platform in
    every case. The three other builds answered: 0.23.0 stale in audit, 0.25.1 crashing, 0.26.0 clean."""
    doc, rows, run, got = replayed(monkeypatch, tmp_path, "h200-release-sweep-fast")
    log = (
        RESULTS / "h200-release-sweep-fast" / "logs" / f"{V}0.24.0-under-test-compile-none-plain.out.log"
    ).read_text()
    assert "Device string must not be empty" in log
    assert {
        got[f"{V}{b}-under-test-compile-none-{m}"].verdict for b in ("0.24.0", "0.25.0") for m in ("audit", "plain")
    } == {"error"}
    assert got[f"{V}0.23.0-under-test-compile-none-audit"].verdict == "stale-audit"
    assert got[f"{V}0.25.1-control-compile-none-plain"].kernel == "combine"
    assert got[f"{V}0.26.0-under-test-compile-none-plain"].verdict == "clean"
