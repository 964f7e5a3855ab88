"""The GPU records of the session of 2026-12-03, judged again on a CPU from what each case process left:

- results/h200-eagle-0.20.2-0.21.0-alone: 0.20.2 and 0.21.0 alone on the GPU with their self controls (issue 26,
  item 4): 0.20.2 clean and its self control caught, 0.21.0 stale in its draft's prefill captures, so the affected range
  starts at 0.21.0, measured;
- results/h200-readme-gate-7: the README's gate line on this code, alone: PASS;
- results/h200-release-sweep-fast-2: five releases (0.24.0 and 0.25.0 as overlays) on the fast path, cold, under the
  120 s of issue 29;
- results/h200-unseen-sm-12-32: SM configurations no earlier record held (sm_margin and MPS at 12 SMs, MPS at 32): no
  false alarm on 0.26.0, no miss on 0.25.1;
- results/h200-initcheck-own-nofill: compute-sanitizer's initcheck over memcheck:own's allocator without its fill
  (issue 31): the cases ran out of their time inside torch's own copies, so the gate could not vouch."""

from __future__ import annotations

import json
import lzma
from pathlib import Path

from repro.exit_codes import gate as gate_exit
from repro.run.channel import Channel
from repro.run.tags import DEVICE_TAG
from repro.vllm_integration.gate.report import to_json
from tests.recorded_gate import replay

RESULTS = Path(__file__).resolve().parent.parent / "results"
V = "stale_metadata-vllm-"
FAULTS = ("crash", "hang", "oob")


def _same_verdicts(got, rows, run=None):
    """The replayed verdicts are the recorded ones, a self control's further attempts (run.attempts) included."""
    if run is not None:
        got = {**got, **{c.case_id: r for c, r in run.attempts}}
    assert {k: r.verdict for k, r in got.items()} == {k: row["verdict"] for k, row in rows.items()}


def test_the_affected_range_starts_at_0210_measured_alone(monkeypatch, tmp_path):
    record = RESULTS / "h200-eagle-0.20.2-0.21.0-alone"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    _same_verdicts(got, rows, run)
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


def test_the_readme_gate_line_passes_alone(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-readme-gate-7")
    _same_verdicts(got, rows)
    assert all(got[f"{V}0.26.0-under-test-{m}"].verdict == "clean" for m in ("audit", "plain"))
    assert all(got[f"{V}0.26.0-self-control-{m}"].verdict in FAULTS for m in ("audit", "plain"))
    assert got[f"{V}0.25.1-control-audit"].verdict == "stale-audit"  # its plain mode: rule 5's listed miss
    assert run.outcome() == doc["outcome"] == "PASS" and gate_exit(run.outcome()) == 0


def test_five_releases_cold_on_the_fast_path_under_two_minutes(monkeypatch, tmp_path):
    record = RESULTS / "h200-release-sweep-fast-2"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    _same_verdicts(got, rows)
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


def test_unseen_sm_configurations_no_false_alarm_no_miss(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-unseen-sm-12-32")
    _same_verdicts(got, rows)
    for label in ("audit-smmargin12", "smmargin12", "mps12", "mps32"):
        assert got[f"{V}0.26.0-under-test-compile-none-{label}"].verdict == "clean", label
        assert got[f"{V}0.25.1-control-compile-none-{label}"].verdict in FAULTS, label
    # every MPS process, case and reference, reported the SMs it was given
    logs = RESULTS / "h200-unseen-sm-12-32" / "logs"
    for sms in (12, 32):
        for case in ("0.26.0-under-test-compile-none", "0.26.0-under-test-reference", "0.25.1-control-reference"):
            device = Channel.of_case(logs / f"{V}{case}-mps{sms}.out.log").last(DEVICE_TAG)
            assert device["sms"] == sms, (case, sms)
    assert run.outcome() == doc["outcome"] == "PASS"


def test_initcheck_on_memcheck_owns_allocator_cannot_vouch(monkeypatch, tmp_path):
    record = RESULTS / "h200-initcheck-own-nofill"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    _same_verdicts(got, rows)
    assert run.outcome() == doc["outcome"] == "CANNOT VOUCH"
    for case in ("0.26.0-under-test", "0.25.1-control"):
        res = got[f"{V}{case}-compile-none-memcheck-own"]
        # the allocator installed itself, then the process ran out of its time before vLLM loaded any plugin: the
        # error says so (the recorded reason, written before, blamed the plugin's install)
        assert res.verdict == "error" and res.reason.startswith("the process was stopped before vLLM loaded"), res
        log = lzma.decompress((record / "logs" / f"{V}{case}-compile-none-memcheck-own.memcheck.log.xz").read_bytes())
        text = log.decode(errors="replace")
        # every finding it printed is torch copying memory nobody wrote, none is in an FA3 kernel
        assert text.count("Uninitialized access") == text.count("on access by cudaMemcpy source") == 200


def test_kept_forkservers_meet_the_per_build_goals_again_on_this_code():
    # results/h200-paths-kept-2: the kept paths re-measured after this session's changes (issue 29), with the verdicts
    # of results/h200-paths-kept's old path
    doc = json.loads((RESULTS / "h200-paths-kept-2" / "paths.json").read_text())
    before = json.loads((RESULTS / "h200-paths-kept" / "paths.json").read_text())["paths"]["old"]
    paths = doc["paths"]
    assert list(paths) == ["kept (cold)", "kept (warm)"] and "--compile none" in doc["environment"]["command"]
    verdicts = {p: {c: e["verdict"] for c, e in v["cases"].items()} for p, v in {**paths, "old": before}.items()}
    assert verdicts["old"] == verdicts["kept (cold)"] == verdicts["kept (warm)"]
    assert {v["outcome"] for v in paths.values()} == {"PASS"}
    assert paths["kept (cold)"]["build_wall_s"]["0.26.0"] < 60 and paths["kept (warm)"]["build_wall_s"]["0.26.0"] < 30
    cold, warm = (paths[p]["launches"]["0.26.0"] for p in ("kept (cold)", "kept (warm)"))
    assert cold["forkserver"]["pid"] == warm["forkserver"]["pid"] and warm["forkserver"]["kept"]["reused"]
