"""No false alarm and no miss, judged again on a CPU from the H200 records: the README's gate line passes alone
(results/h200-readme-gate-7), and SM configurations no earlier record held (results/h200-unseen-sm-12-32) give
neither."""

from __future__ import annotations

from repro.contract.channel import Channel
from repro.contract.tags import DEVICE_TAG
from repro.exit_codes import gate as gate_exit
from tests.recorded_gate import FAULTS, replay, same_verdicts
from tests.records import RESULTS

V = "stale_metadata-vllm-"


def test_the_readme_gate_line_passes_alone(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-readme-gate-7")
    same_verdicts(got, rows)
    assert all(got[f"{V}0.26.0-under-test-{m}"].verdict == "clean" for m in ("audit", "plain"))
    assert all(got[f"{V}0.26.0-self-control-{m}"].verdict in FAULTS for m in ("audit", "plain"))
    assert got[f"{V}0.25.1-control-audit"].verdict == "stale-audit"  # its plain mode: rule 5's listed miss
    assert run.outcome() == doc["outcome"] == "PASS" and gate_exit(run.outcome()) == 0


def test_unseen_sm_configurations_no_false_alarm_no_miss(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-unseen-sm-12-32")
    same_verdicts(got, rows)
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
