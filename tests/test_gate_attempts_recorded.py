"""Every attempt of a self control is in results.json (its row's `attempts`, gate.process.Attempt): a self control
whose first attempt decoded without a fault and whose second crashed keeps the second's result under its own id and
the first attempt's own exit beside it, so a replay of its record remakes both attempts as they ran and judges the run
whole. Stand-in case processes (no GPU): run_attributed answering in turn, or the processes an H200 record left
(results/h200-sm16-fork-0.34.0-2, written before rows kept their attempts) with a stand-in exit for the first
attempt it lacks."""

from __future__ import annotations

import json

import pytest

from repro.case.spec import CaseResult
from repro.contract.verdicts import CLEAN, CRASH
from repro.errors import MissingKey
from repro.report.records import upgrade_gate_row
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import report
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.process import Attempt, recorded_attempts
from repro.vllm_integration.plugin.inject import STALE_CAPTURE
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild
from tests.recorded_gate import replay, same_verdicts
from tests.records import RESULTS

V = "stale_metadata-vllm-0.26.0-"


def _clean_then_crash(monkeypatch, tmp_path) -> dict:
    """A gate run (audit, plain; the self control's first form) whose stand-in processes are clean, but for the plain
    self control's first attempt (clean, exit 0, 30 s) and second (a crash, exit 1, 12 s): its results.json."""

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        if case.inject and case.mode.name == "plain":
            verdict, code, wall = ((CLEAN, 0, 30.0), (CRASH, 1, 12.0), (CLEAN, 0, 9.0))[case.attempt]
        else:
            verdict, code, wall = CLEAN, 0, 5.0
        wrote = {"injection": [{"injection_wrote": 1}]} if case.inject else None  # judge.vouch: the injection wrote
        res = CaseResult(
            case.case_id, verdict, f"stand-in {verdict}", returncode=code, wall_s=wall, backend_identity=wrote
        )
        return res, None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    run = gate_run.run_gate(
        [build], parse_modes("audit,plain"), tmp_path / "logs", jobs=2, self_control_forms=(STALE_CAPTURE,)
    )
    return json.loads(json.dumps(report.to_json(run), default=str))  # as results.json holds it


def test_a_self_control_clean_then_crashing_keeps_both_attempts_beside_its_kept_result(monkeypatch, tmp_path):
    rows = {row["case"]: row for row in _clean_then_crash(monkeypatch, tmp_path)["cases"]}
    control = rows[V + "self-control-plain"]
    assert control["verdict"] == CRASH and "self-control attempt" in [h["step"] for h in control["result"]["history"]]
    assert control["attempts"] == [
        {
            "attempt": 1,
            "case": V + "self-control-plain",
            "returncode": 0,
            "timed_out": False,
            "verdict": CLEAN,
            "reason": "stand-in clean",
            "wall_s": 30.0,
            "log": V + "self-control-plain.out.log",
        },
        {
            "attempt": 2,
            "case": V + "self-control-plain-attempt2",
            "returncode": 1,
            "timed_out": False,
            "verdict": CRASH,
            "reason": "stand-in crash",
            "wall_s": 12.0,
            "log": V + "self-control-plain-attempt2.out.log",
        },
    ]
    assert [a.verdict for a in recorded_attempts(control)] == [CLEAN, CRASH]  # typed again, as a replay reads it
    # every other case ran once: its one attempt; a reference's or a further attempt's row has none of its own
    for case in ("under-test-audit", "under-test-plain", "self-control-audit"):
        assert [(a.attempt, a.case, a.verdict) for a in recorded_attempts(rows[V + case])] == [(1, V + case, CLEAN)]
    assert rows[V + "self-control-plain-attempt2"]["kind"] == "attempt"
    assert all(recorded_attempts(r) == [] for r in rows.values() if r["kind"] != "case")


def test_a_live_row_without_its_attempts_is_an_error_an_older_recorded_one_is_marked_by_the_upgrader():
    live = {"case": "x", "kind": "case", "verdict": CLEAN}
    with pytest.raises(MissingKey, match="attempts"):
        recorded_attempts(live)
    assert recorded_attempts(upgrade_gate_row(live)) is None  # recorded before rows kept them: replayed as before
    kept = {**live, "attempts": []}
    assert upgrade_gate_row(kept) is kept and recorded_attempts(kept) == []
    one = Attempt(1, "x", 0, False, CLEAN, "ok", 3.0, "x.out.log").to_dict()
    del one["timed_out"]
    with pytest.raises(MissingKey, match="timed_out"):
        recorded_attempts({**kept, "attempts": [one]})


RECORD = RESULTS / "h200-sm16-fork-0.34.0-2"
V34 = "stale_metadata-vllm-0.34.0-"


def test_a_record_with_every_attempt_replays_a_clean_then_crashing_self_control_to_the_same_verdicts(
    monkeypatch, tmp_path
):
    """The H200 record's self control in sm_margin:16 decoded without a fault, then crashed on its second attempt;
    the record predates `attempts`, so its replay cannot remake the first (tests/test_default_path_recorded.py). Its
    processes replayed, that first attempt exiting as a clean decode does, give every recorded verdict and the
    outcome; the record the gate writes of that run keeps both attempts, and its own replay gives them again."""
    first = V34 + "self-control-smmargin16"
    doc, rows, run, got = replay(monkeypatch, tmp_path / "live", RECORD, exits={first: (0, False, 60.0)})
    assert [(a.case, a.verdict, a.returncode) for a in run.attempted[first]] == [
        (first, CLEAN, 0),
        (first + "-attempt2", CRASH, 1),
    ]
    same_verdicts(got, rows, run)  # the whole run, the self control included
    assert run.outcome() == doc["outcome"] == "PASS"
    written = tmp_path / "record"
    report.write(run, written, doc["environment"])
    (written / "logs").symlink_to(RECORD / "logs", target_is_directory=True)
    again_doc, again_rows, again, again_got = replay(monkeypatch, tmp_path / "again", written)
    assert again_rows[first]["attempts"] == [a.to_dict() for a in run.attempted[first]]
    same_verdicts(again_got, again_rows, again)  # each case's attempts among them
    assert {k: r.verdict for k, r in again_got.items()} == {k: r.verdict for k, r in got.items()}
    assert again.outcome() == again_doc["outcome"] == "PASS"
