"""A self control outside the audit mode that decoded without a fault gets further attempts (gate.process.run_control):
its fault, like the real defect's, hangs on what memory the stale launch reads (results/h200-paths-29-partial: the
same injection crashed cold and decoded cleanly warm). Stand-in case processes: which cases run again, which result
is kept and what it says, and that a build under test never runs again."""

from __future__ import annotations

import threading

from repro.case.spec import CaseResult
from repro.judge.verdicts import CLEAN, CRASH
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.case import GateCase, parse_modes
from repro.vllm_integration.gate.report import rows
from repro.vllm_integration.plugin.inject import STALE_CAPTURE
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

V = "stale_metadata-vllm-0.26.0-"


def _control(monkeypatch, tmp_path, mode, inject, verdicts):
    """run_control on one case; the stand-in processes answer `verdicts` in turn."""
    seen, answers = [], list(verdicts)

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        seen.append(case.case_id)
        return CaseResult(case.case_id, answers.pop(0), "stand-in"), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    case = GateCase(build, parse_modes(mode)[0], inject=inject)
    res, _, ran, tried = gate_process.run_control(case, [build], tmp_path)
    assert [c.case_id for c, _ in tried] == seen[1:]  # every further attempt comes back, the kept one among them
    return case, res, ran, seen


def test_a_self_control_that_decoded_cleanly_runs_again_and_its_later_fault_is_kept(monkeypatch, tmp_path):
    case, res, ran, seen = _control(monkeypatch, tmp_path, "plain", STALE_CAPTURE, [CLEAN, CRASH, CLEAN])
    assert seen == [V + "self-control-plain", V + "self-control-plain-attempt2"]  # stops at the first fault
    assert res.verdict == CRASH and res.case_id == case.case_id and ran.case_id == V + "self-control-plain-attempt2"
    assert res.history[-1]["step"] == "self-control attempt" and "attempt 2 of 3" in res.history[-1]["why"]


def test_a_self_control_silent_in_every_attempt_keeps_its_first_result(monkeypatch, tmp_path):
    case, res, ran, seen = _control(monkeypatch, tmp_path, "sm_margin:16", STALE_CAPTURE, [CLEAN] * 3)
    assert len(seen) == gate_process.SELF_CONTROL_ATTEMPTS == 3 and seen[-1].endswith("-attempt3")
    assert res.verdict == CLEAN and not res.history and ran is case


def test_the_build_under_test_and_the_audit_mode_run_once(monkeypatch, tmp_path):
    assert _control(monkeypatch, tmp_path, "plain", None, [CLEAN])[3] == [V + "under-test-plain"]
    assert _control(monkeypatch, tmp_path, "audit", STALE_CAPTURE, [CLEAN])[3] == [V + "self-control-audit"]


def test_the_gate_runs_its_cases_through_the_attempts(monkeypatch, tmp_path):
    seen, lock = [], threading.Lock()

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        with lock:
            seen.append(case.case_id)
        return CaseResult(case.case_id, CLEAN, "stand-in"), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    run = gate_run.run_gate([build], parse_modes("audit,plain"), tmp_path / "logs", jobs=2, self_control="under-test")
    assert sorted(s for s in seen if "attempt" in s) == [
        V + "self-control-plain-attempt2",
        V + "self-control-plain-attempt3",
    ]
    # results.json keeps them (kind "attempt"), so a replay of the record makes the same attempts
    assert sorted(x["case"] for x in rows(run) if x["kind"] == "attempt") == [
        V + "self-control-plain-attempt2",
        V + "self-control-plain-attempt3",
    ]
