"""Why a gate run cannot vouch (gate.why) is decided by each result's typed data, never by the words of its reason: an
untrusted reference is a flag its validation sets and the comparison carries to every case judged against it, a CUDA
error a flag the one classifier of process output sets from the line it quotes. A reason reworded changes no cause;
words that only look like one are none. Records written before these flags get them from the one upgrader of
recorded results (repro.report.records.upgrade_result), and only there."""

from __future__ import annotations

from dataclasses import replace

from repro.case.spec import CUDA_ERROR, UNTRUSTED_REFERENCE, CaseResult, CaseSpec, SmConfig
from repro.contract.verdicts import CLEAN, ERROR
from repro.judge.classify import classify
from repro.report.records import upgrade_result
from repro.vllm_integration.gate import judge as gate_judge
from repro.vllm_integration.gate import why
from repro.vllm_integration.gate.case import reference_for
from tests.test_reports_say_why import DEVICE_ASSERT
from tests.test_vouch_rules import case

REWORDED = "a reason in other words"


def _judged_against_an_untrusted_reference() -> tuple[CaseResult, CaseResult]:
    """(the reference, a case compared with it) as the gate's own steps make them: a clean reference run that decoded
    no tokens, not trusted by its validation; a clean case compared with it."""
    ref_case = reference_for(case("plain"))
    ref = gate_judge.validate_reference(ref_case, CaseResult(ref_case.case_id, CLEAN, "ran"), None)
    out = {"tokens": [[1, 2, 3]]}
    judged = gate_judge.apply_reference(CaseResult(case("plain").case_id, CLEAN, "ran"), out, ref, None)
    return ref, judged


def test_an_untrusted_reference_and_its_cases_carry_the_flag_their_cause_is_read_from():
    ref, judged = _judged_against_an_untrusted_reference()
    assert (ref.verdict, judged.verdict) == (ERROR, ERROR)
    assert UNTRUSTED_REFERENCE in ref.flags and UNTRUSTED_REFERENCE in judged.flags
    assert why.cause(ref) == why.cause(judged) == why.UNTRUSTED


def test_an_untrusted_reference_reworded_is_still_the_cause():
    for res in _judged_against_an_untrusted_reference():
        assert why.cause(replace(res, reason=REWORDED)) == why.UNTRUSTED, res


def test_a_reason_quoting_reference_not_trusted_without_the_flag_is_no_untrusted_reference():
    said = CaseResult("c", ERROR, "exit status 1 without a result: ValueError: reference not trusted by the tokenizer")
    assert why.cause(said) == why.NO_RESULT


def test_a_cuda_error_is_the_flag_classify_sets_from_the_line_it_quotes():
    spec = CaseSpec("vllm", "stale", "eager", sm=SmConfig("mps", 56), timeout_s=90)
    r = classify(spec, "a line before\n" + DEVICE_ASSERT, 1, False, None, 7.0)
    assert r.verdict == ERROR and CUDA_ERROR in r.flags
    assert why.cause(r) == why.cause(replace(r, reason=REWORDED)) == why.CUDA
    # the same process ending on another error: no CUDA error
    other = classify(spec, "a line before\nRuntimeError: the engine core died\n", 1, False, None, 7.0)
    assert other.verdict == ERROR and CUDA_ERROR not in other.flags and why.cause(other) == why.NO_RESULT


def test_an_error_whose_words_look_like_a_cuda_error_without_the_flag_is_none():
    said = CaseResult("c", ERROR, "plugin features not installed (case verdict would have been hang: Assertion text)")
    assert why.cause(said) == why.NO_RESULT


def test_a_case_judged_against_a_reference_with_a_cuda_error_has_the_references_cause():
    ref = CaseResult("ref", ERROR, REWORDED, flags=[CUDA_ERROR])
    judged = gate_judge.apply_reference(CaseResult("c", CLEAN, "ran"), {"tokens": [[1]]}, ref, None)
    assert judged.verdict == ERROR and CUDA_ERROR in judged.flags and why.cause(judged) == why.CUDA


def test_only_the_upgrader_turns_an_old_records_words_into_these_flags():
    untrusted = {"reason": "reference not trusted: the reference run decoded no tokens", "flags": []}
    compared = {"reason": "no reference to compare with (r: error: reference not trusted: x)", "flags": []}
    cuda = {"reason": "exit status 1 without a result: torch.AcceleratorError: CUDA error: device-side assert"}
    assert upgrade_result(untrusted)["flags"] == upgrade_result(compared)["flags"] == [UNTRUSTED_REFERENCE]
    assert upgrade_result(cuda)["flags"] == [CUDA_ERROR]
    assert upgrade_result({"reason": "exit status 1 without a result: RuntimeError: died", "flags": []})["flags"] == []
    kept = upgrade_result({**cuda, "flags": [CUDA_ERROR]})["flags"]
    assert kept == [CUDA_ERROR]  # a flag it has is not added twice
