"""The draft judged by what the target accepted (gate_judge.compare_acceptance, reference_problems): a drop beyond
ACCEPTANCE_DROP below the speculative reference is wrong output, a reference whose draft does not agree cannot judge
one, a case without counters cannot vouch, and a recorded reference without speculative decoding leaves its record alone."""

from __future__ import annotations

import pytest

from repro.case.spec import CaseResult
from repro.contract.channel import ACCEPTANCE, RECORDED_BEFORE
from repro.contract.verdicts import CANNOT_VOUCH, CLEAN, ERROR, WRONG
from repro.vllm_integration.gate import judge as gate_judge
from repro.vllm_integration.gate.case import GateCase, reference_for
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild


def counters(accepted, drafted):
    return {
        "spec_decode_num_drafts": drafted // 3,
        "spec_decode_num_draft_tokens": drafted,
        "spec_decode_num_accepted_tokens": accepted,
    }


def result(case_id, acc, verdict=CLEAN, spec=True):
    engine = {
        "speculative_method": "eagle" if spec else None,
        "num_speculative_tokens": 3 if spec else 0,
        "cudagraph_mode": "NONE",
    }
    return CaseResult(case_id, verdict, "", backend_identity={"engine": engine, "counters": {}, "acceptance": acc})


def test_a_draft_accepted_as_often_as_without_graphs_is_clean_and_said():
    res = gate_judge.compare_acceptance(result("c", counters(170, 180)), result("r", counters(180, 180)))
    assert res.verdict == CLEAN
    assert "draft: 170 of 180 draft tokens accepted (94%), reference 100%" in res.evidence


def test_a_drop_beyond_noise_is_a_silently_wrong_draft():
    res = gate_judge.compare_acceptance(result("c", counters(20, 180)), result("r", counters(180, 180)))
    assert res.verdict == WRONG
    assert "silently wrong" in res.reason and "20 of 180" in res.reason and "180 of 180" in res.reason


@pytest.mark.parametrize("acc", [None, {"unavailable": "stats off"}, counters(0, 0)])
def test_a_case_without_acceptance_cannot_vouch_against_a_speculative_reference(acc):
    res = gate_judge.compare_acceptance(result("c", acc), result("r", counters(180, 180)))
    assert res.verdict == CANNOT_VOUCH


def test_a_recorded_reference_from_before_references_drafted_leaves_the_record_as_it_was():
    """Marked so by the replays' upgrader (an ENGINE record without acceptance), or without any ENGINE record."""
    case = result("c", counters(0, 180))
    old = result("r", None, spec=False)
    old.backend_identity["engine"][RECORDED_BEFORE] = [ACCEPTANCE]
    assert gate_judge.compare_acceptance(case, old) is case
    assert gate_judge.compare_acceptance(case, CaseResult("r", CLEAN, "", backend_identity=None)) is case


@pytest.mark.parametrize("acc", [None, {"unavailable": "stats off"}, counters(0, 0)])
def test_a_live_reference_without_acceptance_cannot_judge_a_case_that_drafted(acc):
    """The reference ran no draft (or reported none) while the case did: nothing to judge the case's draft by."""
    res = gate_judge.compare_acceptance(result("c", counters(0, 180)), result("r", acc, spec=acc is not None))
    assert res.verdict == CANNOT_VOUCH and "its reference reported" in res.reason
    neither = result("c", None, spec=False)  # no speculation in either: nothing to compare, nothing said
    assert gate_judge.compare_acceptance(neither, result("r", acc, spec=False)) is neither


def _case():
    build = VllmBuild("0.26.0", None, UNDER_TEST)
    return GateCase(build=build, mode=GateMode.parse("plain"))


def _ref_out():
    return {"tokens": [[5, 6, 7, 8]], "margins": [[20.0, 21.0, 19.5, 20.2]], "nonfinite": [], "device": {"sms": 132}}


def test_a_reference_whose_draft_disagrees_cannot_judge_a_draft():
    ref_case = reference_for(_case())
    probs = gate_judge.reference_problems(ref_case, result("r", counters(0, 180)), _ref_out())
    assert any("below 50%" in p for p in probs)
    res = gate_judge.validate_reference(ref_case, result("r", counters(0, 180)), _ref_out())
    assert res.verdict == ERROR


def test_a_reference_whose_draft_agrees_is_validated_with_its_smallest_margin_and_acceptance():
    ref_case = reference_for(_case())
    res = gate_judge.validate_reference(ref_case, result("r", counters(177, 180)), _ref_out())
    assert res.verdict == CLEAN
    assert "smallest top-2 margin 19.500 nats" in res.evidence and "177 of 180" in res.evidence
