"""A self control outside the audit mode that decoded without a fault gets further attempts (gate.process.run_control):
its fault, like the real defect's, hangs on what memory the stale launch reads (results/h200-paths-29-partial: the
same injection crashed cold and decoded cleanly warm). Stand-in case processes: which cases run again, which result
is kept and what it says, and that a build under test never runs again."""

from __future__ import annotations

import threading

from repro.case.spec import CaseResult
from repro.contract.channel import path_for, write_record
from repro.contract.tags import RESULT_TAG
from repro.contract.verdicts import CLEAN, CRASH
from repro.run.runner import case_logs
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.report import rows
from repro.vllm_integration.plugin.inject import STALE_CAPTURE, STALE_DESCRIPTOR
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

V = "stale_metadata-vllm-0.26.0-"


def _control(
    monkeypatch, tmp_path, mode, inject, verdicts, reference=lambda: None, tokens=None, wrote=None, caught=lambda: None
):
    """run_control on one case; the stand-in processes answer `verdicts` in turn (and write `tokens` as their RESULT
    record, when given); `reference`: run_control's, the reference's result and record once it finished; `wrote`:
    whether each attempt's injection wrote (judge.vouch discounts a self control's evidence without), all by default."""
    seen, answers, writes = [], list(verdicts), list(wrote or [True] * len(verdicts))

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        seen.append(case.case_id)
        if tokens is not None:
            write_record(path_for(case_logs(log_dir, case.case_id)[0]), RESULT_TAG, {"tokens": tokens})
        injection = [{"injection_wrote": 1}] if writes.pop(0) else []
        return CaseResult(case.case_id, answers.pop(0), "stand-in", backend_identity={"injection": injection}), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    case = GateCase(build, parse_modes(mode)[0], inject=inject)
    res, _, ran, tried = gate_process.run_control(case, [build], tmp_path, reference=reference, caught_beside=caught)
    assert [c.case_id for c, _ in tried] == seen  # every attempt comes back, the first and the kept one among them
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


def test_a_clean_attempt_already_wrong_against_its_finished_reference_is_not_run_again(monkeypatch, tmp_path):
    # 0.21.0's self control (results/h200-eagle-0.20.2-0.21.0): no fault, a silently wrong draft; the comparison the
    # run ends with is made as soon as the reference has finished, and a wrong answer there is the mode's evidence
    ref = (CaseResult("ref", CLEAN, "stand-in"), {"tokens": [[5, 6, 7]], "margins": [[19.0, 19.0, 19.0]]})
    wrong = _control(monkeypatch, tmp_path, "plain", STALE_CAPTURE, [CLEAN] * 3, lambda: ref, [[5, 9, 7]])
    assert wrong[3] == [V + "self-control-plain"] and wrong[1].verdict == CLEAN and wrong[2] is wrong[0]
    # the same tokens as the reference: no evidence yet, so the attempts go on; no reference yet: they go on too
    right = _control(monkeypatch, tmp_path, "plain", STALE_CAPTURE, [CLEAN] * 3, lambda: ref, [[5, 6, 7]])
    assert len(right[3]) == 3
    assert len(_control(monkeypatch, tmp_path, "plain", STALE_CAPTURE, [CLEAN] * 3, tokens=[[5, 9, 7]])[3]) == 3
    # wrong tokens from an attempt whose injection never wrote are no evidence at the end (judge.vouch), so none here:
    # the next attempt runs, and its wrong tokens, the injection written, are kept
    case, res, ran, seen = _control(
        monkeypatch, tmp_path, "plain", STALE_CAPTURE, [CLEAN] * 3, lambda: ref, [[5, 9, 7]], wrote=[False, True, True]
    )
    assert seen == [V + "self-control-plain", V + "self-control-plain-attempt2"] and ran.case_id == seen[1]
    assert res.case_id == case.case_id and "attempt 2 of 3" in res.history[-1]["why"]


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
    attempts = [  # each form of the self control its own attempts
        V + f"self-control-{form}plain-attempt{k}" for form in ("", "stale-descriptor-") for k in (2, 3)
    ]
    assert sorted(s for s in seen if "attempt" in s) == sorted(attempts)
    # results.json keeps them (kind "attempt"), so a replay of the record makes the same attempts
    assert sorted(x["case"] for x in rows(run) if x["kind"] == "attempt") == sorted(attempts)


def test_a_timeout_before_the_captures_is_no_evidence_and_the_attempts_go_on(monkeypatch, tmp_path):
    """An attempt stopped at its timeout before vLLM began capturing (annotate: an error, step HUNG_EARLY) says
    nothing of the captures: it neither ends the attempts nor replaces the result as if it were evidence."""
    from repro.contract.verdicts import ERROR, HANG
    from repro.vllm_integration.gate.judge import HUNG_EARLY

    def early(cid):
        return CaseResult(cid, HANG, "no exit within 300 s").revised(HUNG_EARLY, "before capture", verdict=ERROR)

    answers = [lambda cid: CaseResult(cid, CLEAN, "stand-in"), early, lambda cid: CaseResult(cid, CRASH, "stand-in")]
    seen = []

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        seen.append(case.case_id)
        return answers.pop(0)(case.case_id), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    case = GateCase(build, parse_modes("plain")[0], inject=STALE_CAPTURE)
    res, _, ran, tried = gate_process.run_control(case, [build], tmp_path)
    assert len(seen) == 3 and res.verdict == CRASH and ran.case_id.endswith("-attempt3")
    assert [r.verdict for _, r in tried] == [CLEAN, ERROR, CRASH]


def test_a_deadline_cut_is_a_skip_whatever_annotate_made_of_the_hang(tmp_path):
    """past_deadline: a case the run's --deadline stopped is a skip, also where annotate had revised the hang (before
    the captures, or before vLLM loaded the plugin); a stall the watch stopped stays what it is."""
    from repro.case.spec import STALLED
    from repro.contract.verdicts import ERROR, HANG, SKIP

    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    case = GateCase(build, parse_modes("plain")[0])
    hang = CaseResult(case.case_id, HANG, "no exit within 20 s")
    for step in ("hang before capture", "plugin"):
        assert gate_process.past_deadline(case, hang.revised(step, "x", verdict=ERROR)).verdict == SKIP
    assert gate_process.past_deadline(case, hang).verdict == SKIP
    crash = CaseResult(case.case_id, CRASH, "fault")
    assert gate_process.past_deadline(case, crash) is crash
    stalled = CaseResult(case.case_id, HANG, "stalled", flags=[STALLED])
    assert gate_process.past_deadline(case, stalled) is stalled


def test_a_later_attempts_row_with_no_draft_token_accepted_is_not_clean(monkeypatch, tmp_path):
    # vLLM 0.30.0's plain self control: its later attempts decoded without a fault, 0 of 180 draft tokens accepted
    # against a reference's 100%; their rows read `clean` when only the first attempt was judged against the reference
    from repro.contract.verdicts import WRONG

    def acceptance(accepted: int) -> dict:
        return {"spec_decode_num_accepted_tokens": accepted, "spec_decode_num_draft_tokens": 180}

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        out = path_for(case_logs(log_dir, case.case_id)[0])
        out.parent.mkdir(parents=True, exist_ok=True)
        write_record(out, RESULT_TAG, {"tokens": [[5, 6, 7]], "margins": [[19.0, 19.0, 19.0]], "nonfinite": 0})
        # the first attempt accepts as the reference does (clean, so further attempts run); the later ones accept none
        later_attempt = case.inject and case.mode.name == "plain" and "attempt" in case.case_id
        accepted = 0 if later_attempt else 180
        wrote = {"injection": [{"injection_wrote": 1}]} if case.inject else {}
        return CaseResult(
            case.case_id, CLEAN, "stand-in", backend_identity={"acceptance": acceptance(accepted), **wrote}
        ), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    monkeypatch.setattr(gate_run, "validate", lambda case, res, out: res)  # the stand-in reference is trusted
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    run = gate_run.run_gate(
        [build], parse_modes("audit,plain"), tmp_path / "logs", jobs=1, self_control_forms=(STALE_CAPTURE,)
    )
    later = {x["case"]: x["verdict"] for x in rows(run) if x["kind"] == "attempt"}
    assert later and all(v == WRONG for v in later.values()), later


def test_no_further_attempt_once_another_form_of_the_self_control_was_caught_in_its_mode(monkeypatch, tmp_path):
    """DFlash's stale-capture control decodes right in plain (policy rule 6 lists it beside its caught stale-descriptor
    form): its two further attempts were the warm gate's critical path on the H100 (h100-gate-default-2-warm)."""
    why = "the self control's form stale-descriptor in this mode showed crash (x)"
    case, res, ran, seen = _control(monkeypatch, tmp_path, "plain", STALE_CAPTURE, [CLEAN] * 3, caught=lambda: why)
    assert seen == [V + "self-control-plain"] and res.verdict == CLEAN and ran is case
    assert res.reason.endswith(f"no further attempt: {why}") and res.history[-1]["why"] == why


def _form(build, mode, inject, method="eagle"):
    return GateCase(build, parse_modes(mode)[0], inject=inject, method=method)


def test_a_form_counts_as_caught_only_with_kernel_evidence_its_injection_wrote_in_the_same_mode_and_method(tmp_path):
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    me = _form(build, "plain", STALE_CAPTURE)
    wrote = {"injection": [{"injection_wrote": 1}]}

    def caught(other, verdict, identity=wrote):
        return gate_process.form_caught(me, [(other, CaseResult(other.case_id, verdict, "x", backend_identity=identity))],
                                        threading.Lock())  # fmt: skip

    assert caught(_form(build, "plain", STALE_DESCRIPTOR), CRASH).startswith("the self control's form stale-descriptor")
    assert caught(_form(build, "plain", STALE_DESCRIPTOR), CLEAN) is None
    assert caught(_form(build, "plain", STALE_DESCRIPTOR), CRASH, {"injection": []}) is None  # never wrote
    assert caught(_form(build, "audit", STALE_DESCRIPTOR), CRASH) is None  # another mode
    assert caught(_form(build, "plain", STALE_DESCRIPTOR, method="dflash"), CRASH) is None  # another method
    assert caught(_form(build, "plain", STALE_CAPTURE), CRASH) is None  # its own form (another attempt's)
    assert caught(_form(build, "plain", None), CRASH) is None  # the build under test
