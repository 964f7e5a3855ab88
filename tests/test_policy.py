"""repro.judge.policy's public rules, one test each: which verdicts meet each expectation (MEETS, satisfies), which
expectations are positive, what counts as a mode's evidence, the requirements a run can be given, why one control
fails a gate (problem), a disagreement with the CPU model, and the gate's decision (decide: rules 1-6 of the module's
docstring, and the Failure kinds callers decide by). The verdicts are spelled out here, not taken from the module's
own groups, so a change to a group shows.

Mutation-checked: for each rule, the rule was deleted or weakened in repro/judge/policy.py (a verdict taken out of a MEETS
row, an `if` or a clause of a condition removed), this file was run (`python -m pytest -q tests/test_policy.py`), and
the test named for the rule failed (rules others rest on fail more tests); then the source was restored.
tests/mutation_check.py holds the 41
mutations and the tests each must fail, and runs them (`python tests/mutation_check.py policy`). Two rules every
decision rests on fail the decide tests too: kernel evidence counting as a mode's evidence, and a met expectation
passing (deleting either fails every decide test with such a control besides the rule's own test); and a
positive control passing with evidence of another kind is what a disagreement is, so deleting it fails the
disagreement test too."""

from __future__ import annotations

import pytest

from repro.errors import ConfigError
from repro.judge import policy
from repro.judge.control import KNOWN_BAD, SELF_CONTROL, Control, GatingMode
from repro.judge.decision import (
    CONTROL_FAILED,
    MODE_WITHOUT_EVIDENCE,
    MODE_WITHOUT_POSITIVE,
    NO_POSITIVE,
    NOT_COVERED,
    GateDecision,
)
from repro.judge.policy import decide
from repro.report.pytest_gate import plain
from repro.vllm_integration.gate.modes import GateMode

ALL = ("clean", "oob", "crash", "launch-failure", "hang", "wrong-output", "stale-audit", "cannot-vouch", "error")
KERNEL = ("oob", "crash", "launch-failure", "hang", "wrong-output")


def M(name: str) -> GatingMode:
    """A mode as its tier types it: a vLLM gate mode as GateMode.parse makes it (the auditor's modes, alone or in an
    SM configuration, are the engine's audit), an attention-layer mode (eager, graph) by its name alone."""
    try:
        return GateMode.parse(name).policy_mode
    except ConfigError:
        return GatingMode(name)


def met(expect: str) -> set[str]:
    return {v for v in ALL if policy.satisfies(expect, v)}


def test_fault_is_met_by_the_kernels_failing():
    assert met("fault") == {"oob", "crash", "launch-failure"}


def test_detected_is_met_by_kernel_evidence():
    assert met("detected") == set(KERNEL)


def test_audit_is_met_by_kernel_evidence_or_stale_audit():
    assert met("audit") == {*KERNEL, "stale-audit"}


def test_clean_is_met_by_clean_only():
    assert met("clean") == {"clean"}


def test_recorded_is_met_by_anything_that_ran():
    assert met("recorded") == {"clean", *KERNEL, "stale-audit"}


def test_a_skip_meets_nothing_and_fails_nothing():
    assert all(policy.satisfies(e, "skip") is None for e in policy.EXPECTATIONS)


def test_an_unknown_expectation_is_refused():
    with pytest.raises(ValueError, match="unknown expectation 'faults'"):
        policy.satisfies("faults", "crash")


def test_fault_detected_and_audit_are_the_positive_expectations():
    assert [e for e in policy.EXPECTATIONS if policy.is_positive(e)] == [
        "fault",
        "detected",
        "audit",
        "known-bad",
        "any-form",
    ]


def test_kernel_evidence_counts_in_every_mode():
    assert all(policy.counts_as_evidence(v, M(m)) for v in KERNEL for m in ("eager", "graph", "plain", "audit"))
    assert not any(policy.counts_as_evidence(v, M("audit")) for v in ("clean", "error", "cannot-vouch", "skip"))


def test_stale_audit_counts_only_in_the_engine_audit_mode():
    assert policy.counts_as_evidence("stale-audit", M("audit"))
    # the auditor under an SM restriction (the hidden sweep's audit+ modes) reads the engine's objects all the same
    assert policy.counts_as_evidence("stale-audit", M("audit+mps:16"))
    assert policy.counts_as_evidence("stale-audit", M("audit+sm_margin:8"))
    assert not policy.counts_as_evidence("stale-audit", M("graph"))  # the harness's own bookkeeping: not evidence
    assert not policy.counts_as_evidence("stale-audit", M("mps:16"))
    # the mode's name says nothing by itself: an attention-layer mode named so is the harness's bookkeeping
    assert not policy.counts_as_evidence("stale-audit", GatingMode("audit"))
    cs = [
        Control("u", "clean", "clean", M("audit+mps:16")),
        Control("k", "audit", "stale-audit", M("audit+mps:16"), kind=KNOWN_BAD, subject=("0.25.1", "FLASH_ATTN")),
    ]
    assert policy.decide(cs).passed and policy.decide(cs).evidence == {"audit+mps:16": (1, 1)}


def test_requirements_are_parsed_and_an_unknown_one_refused():
    assert policy.parse_requirements(" mig, vllm ,") == frozenset({"mig", "vllm"})
    assert policy.parse_requirements(None) == frozenset()
    with pytest.raises(ValueError, match=r"\['gpu'\]"):
        policy.parse_requirements("mig,gpu")


def test_another_kind_of_kernel_evidence_is_a_disagreement():
    assert policy.disagrees("fault", "hang")
    assert not policy.disagrees("fault", "crash")
    assert not policy.disagrees("clean", "crash")  # a negative control that crashed failed; it does not disagree
    assert not policy.disagrees("audit", "stale-audit")


# -- problem: why one control fails a gate --


@pytest.mark.parametrize("verdict", ["error", "skip", "cannot-vouch"])
def test_a_control_without_evidence_fails_whatever_it_expected(verdict):
    for expect in ("clean", "detected"):
        assert policy.problem(expect, verdict) == f"{verdict}: the gate has no evidence from this control"


def test_a_control_that_meets_its_expectation_passes():
    assert policy.problem("clean", "clean") is None
    assert policy.problem("recorded", "clean") is None


def test_a_positive_control_passes_with_any_kernel_evidence():
    assert policy.problem("fault", "hang") is None
    assert policy.problem("fault", "wrong-output") is None


def test_a_negative_control_that_is_not_clean_fails():
    assert policy.problem("clean", "crash") == "negative control came back crash"


def test_a_positive_control_without_evidence_fails_saying_what_it_expected():
    met_by = ", ".join(policy.MEETS["detected"])
    assert policy.problem("detected", "clean") == f"positive control came back clean, expected detected ({met_by})"
    assert policy.problem("detected", "stale-audit").startswith("positive control came back stale-audit")


# -- decide --

GOOD = [Control("neg", "clean", "clean", M("graph")), Control("pos", "detected", "crash", M("graph"))]


def test_a_run_whose_controls_all_showed_what_they_must_passes():
    d = decide(GOOD)
    assert d.passed and d.failures == [] and d.ran == 2 and d.evidence == {"graph": (1, 1)}


def test_a_failed_control_fails_the_gate_with_its_case_id():
    d = decide([*GOOD, Control("neg2", "clean", "crash", M("graph"), reason="it crashed")])
    assert not d.passed
    (f,) = d.failures
    assert f.startswith("neg2: ") and f.endswith(": it crashed")
    assert f.kind == CONTROL_FAILED and f.case_id == "neg2"


def test_a_disagreement_is_listed_but_does_not_fail():
    d = decide([*GOOD, Control("pos2", "fault", "hang", M("graph"))])
    assert d.passed and "pos2: hang, the expectation was fault" in d.disagreements


def test_a_recorded_control_neither_fails_nor_counts_as_evidence():
    d = decide(
        [*GOOD, Control("mc", "recorded", "error", M("memcheck")), Control("mc2", "recorded", "oob", M("memcheck"))]
    )
    assert d.passed and "memcheck" not in d.evidence and d.ran == 4


def test_a_control_that_cannot_exist_here_is_not_applicable():
    d = decide([*GOOD, Control("mig", "detected", "skip", M("graph"), not_applicable="no MIG", needs="mig")])
    assert d.passed and d.not_applicable == [("mig", "no MIG")] and d.ran == 2


def test_a_required_feature_absent_fails():
    c = Control("mig", "detected", "skip", M("graph"), not_applicable="no MIG", needs="mig")
    d = decide([*GOOD, c], required=frozenset({"mig"}))
    (f,) = d.failures
    assert f == "mig: required (mig) but no MIG" and f.kind == NOT_COVERED and f.case_id == "mig"
    assert d.not_applicable == []


def test_a_mode_with_only_negative_controls_fails():
    d = decide([*GOOD, Control("neg-eager", "clean", "clean", M("eager"))])
    (f,) = d.failures
    assert f.kind == MODE_WITHOUT_POSITIVE and "mode eager: no positive control ran in it" in f


def test_a_mode_whose_positive_controls_showed_nothing_fails():
    d = decide(
        [*GOOD, Control("pos-eager", "detected", "clean", M("eager")), Control("a", "detected", "clean", M("audit"))]
    )
    audit, eager = [f for f in d.failures if f.kind == MODE_WITHOUT_EVIDENCE]  # by mode
    assert audit.startswith("GATE FAILED: mode audit: none of its 1 positive control(s) produced kernel evidence or ")
    assert "produced kernel evidence or the engine's audit: this environment" in audit  # the engine audit mode
    assert eager.startswith("GATE FAILED: mode eager: none of its 1 positive control(s) produced kernel evidence: ")
    assert d.evidence["eager"] == (1, 0)


def test_a_run_without_any_positive_control_fails():
    (f,) = decide([]).failures
    assert f == "GATE FAILED: no positive control ran: this environment cannot show that it sees the bug"
    assert f.kind == NO_POSITIVE
    assert decide([Control("neg", "clean", "clean", M("graph"))]).failures[-1].kind == NO_POSITIVE


def test_evidence_is_counted_per_kind_of_control():
    d = decide(
        [
            Control("kb", "detected", "crash", M("plain"), kind=KNOWN_BAD),
            Control("sc", "detected", "clean", M("plain"), kind=SELF_CONTROL),
        ]
    )
    assert d.evidence_by_kind == {"plain": {KNOWN_BAD: (1, 1), SELF_CONTROL: (1, 0)}}
    assert d.evidence == {"plain": (2, 1)}


def test_the_summary_names_the_kinds_only_where_there_is_more_than_known_bad():
    kb, sc = KNOWN_BAD, SELF_CONTROL
    both = GateDecision(ran=2, evidence={"plain": (2, 2)}, evidence_by_kind={"plain": {kb: (1, 1), sc: (1, 1)}})
    assert both.summary()[1] == (
        "  mode plain: 2 of 2 positive control(s) showed evidence (known-bad build: 1 of 1; self-control: 1 of 1)"
    )
    one = GateDecision(ran=1, evidence={"plain": (1, 1)}, evidence_by_kind={"plain": {kb: (1, 1)}})
    assert one.summary()[1] == "  mode plain: 1 of 1 positive control(s) showed evidence"


def test_the_summary_groups_not_applicable_cases_by_reason():
    d = GateDecision(ran=2, not_applicable=[(f"mig{i}", "no MIG") for i in range(3)] + [("x", "no MPS")])
    lines = d.summary()
    assert lines[0] == "gate: 2 control(s) ran; 4 not applicable here"
    assert lines[1:] == ["  not applicable (3): no MIG", "  not applicable (1): no MPS"]


# rule 5: a known-bad build is judged over all its modes (results/h200-injection-both-halves-0.26.0: 0.25.1 `clean`
# in plain with the agreement weights, `stale-audit` in audit; the self control crashed in both)
KB, SC = KNOWN_BAD, SELF_CONTROL


def test_known_bad_is_met_by_kernel_evidence_or_the_engine_audit():
    assert met("known-bad") == {*KERNEL, "stale-audit"}
    assert policy.problem("known-bad", "clean") is None  # one mode's miss is decided over the build's modes


def test_a_known_bad_build_silent_in_one_mode_but_caught_in_another_is_a_listed_miss():
    d = decide(
        [
            Control("kb-audit", "audit", "stale-audit", M("audit"), kind=KB, subject=("0.25.1",)),
            Control("kb-plain", "known-bad", "clean", M("plain"), "4 requests decoded", kind=KB, subject=("0.25.1",)),
            Control("sc-audit", "audit", "crash", M("audit"), kind=SC),
            Control("sc-plain", "detected", "crash", M("plain"), kind=SC),
        ]
    )
    assert d.passed, d.failures
    assert d.misses == ["kb-plain: clean (detected in audit)"]
    assert (
        "  known-bad build silent here, detected in another mode or variant (rule 5): kb-plain: clean (detected in audit)"
        in (d.summary())
    )


def test_a_known_bad_build_silent_in_every_mode_fails_naming_its_modes():
    d = decide(
        [
            Control("kb-plain", "known-bad", "clean", M("plain"), "decoded", kind=KB, subject=("0.25.1",)),
            Control("kb-mps", "known-bad", "clean", M("mps:16"), "decoded", kind=KB, subject=("0.25.1",)),
            Control("sc-plain", "detected", "crash", M("plain"), kind=SC),
            Control("sc-mps", "detected", "crash", M("mps:16"), kind=SC),
        ]
    )
    (f,) = d.failures
    assert f.kind == CONTROL_FAILED and f.case_id == "kb-plain"
    assert "known-bad build 0.25.1 showed no evidence in any of its modes (plain: clean, mps:16: clean)" in f


def test_a_mode_whose_only_evidence_would_be_a_silent_known_bad_build_still_fails():
    d = decide(
        [
            Control("kb-audit", "audit", "stale-audit", M("audit"), kind=KB, subject=("0.25.1",)),
            Control("kb-plain", "known-bad", "clean", M("plain"), kind=KB, subject=("0.25.1",)),
        ]
    )
    (f,) = d.failures
    assert f.kind == MODE_WITHOUT_EVIDENCE and "mode plain" in f


def test_a_known_bad_build_that_errored_fails_as_any_control_without_evidence():
    d = decide(
        [
            Control("kb-audit", "audit", "stale-audit", M("audit"), kind=KB, subject=("0.25.1",)),
            Control("kb-plain", "known-bad", "error", M("plain"), kind=KB, subject=("0.25.1",)),
            Control("sc-plain", "detected", "crash", M("plain"), kind=SC),
        ]
    )
    assert [f.case_id for f in d.failures] == ["kb-plain"]


# rule 6: a self control's injection forms are judged together in each mode outside the audit
# (results/h200-dflash-0.34.0-2: DFlash's stale-capture form decoded right in plain, its stale-descriptor form crashed)
def _forms(
    capture: str, descriptor: str, mode: str = "plain", subject: tuple[str, ...] = ("0.34.0", "dflash", "plain")
) -> list:
    return [
        Control(f"sc-{mode}", "any-form", capture, M(mode), "decoded", kind=SC, subject=subject),
        Control(f"sc-desc-{mode}", "any-form", descriptor, M(mode), "", kind=SC, subject=subject),
    ]


def test_any_form_is_met_by_kernel_evidence_and_judged_over_the_forms_of_its_mode():
    assert met("any-form") == set(KERNEL)
    assert policy.problem("any-form", "clean") is None
    assert policy.problem("any-form", "error") is not None  # a form that did not run shows nothing either way


def test_a_self_control_form_silent_beside_a_caught_form_is_a_listed_miss():
    d = decide(_forms("clean", "crash"))
    assert d.passed, d.failures
    assert d.form_misses == ["sc-plain: clean (caught by sc-desc-plain)"] and not d.misses
    assert (
        "  self-control form silent in this mode, another form caught (rule 6): sc-plain: clean (caught by "
        "sc-desc-plain)" in d.summary()
    )
    assert decide(_forms("crash", "wrong-output")).form_misses == []


def test_a_self_control_silent_in_every_form_of_a_mode_fails_naming_its_forms():
    d = decide(_forms("clean", "clean") + _forms("crash", "crash", "mps:16", ("0.34.0", "dflash", "mps:16")))
    assert [f.kind for f in d.failures] == [CONTROL_FAILED, MODE_WITHOUT_EVIDENCE]
    f = d.failures[0]
    assert f.case_id == "sc-plain" and "mode plain" in d.failures[1]
    assert "self control 0.34.0 dflash plain showed no evidence in any of its injection forms" in f
    assert "(sc-plain: clean, sc-desc-plain: clean)" in f


def test_a_form_without_a_subject_is_judged_alone():
    d = decide(
        [Control("sc-a", "any-form", "clean", M("plain"), kind=SC), Control("sc-b", "any-form", "crash", M("plain"))]
    )
    assert [f.case_id for f in d.failures] == ["sc-a"] and d.form_misses == []


def test_forms_are_judged_per_subject_not_across_modes_or_methods():
    """A form caught in another mode, or another method's form in this mode, does not cover a silent self control."""
    d = decide(
        _forms("clean", "clean", "plain", ("0.34.0", "dflash", "plain"))
        + _forms("crash", "crash", "plain", ("0.34.0", "eagle", "plain"))
    )
    assert [f.case_id for f in d.failures] == ["sc-plain"] and "dflash" in d.failures[0]


def test_stale_audit_outside_the_audit_mode_is_not_a_known_bad_builds_evidence():
    d = decide(
        [
            Control("kb-graph", "known-bad", "stale-audit", M("plain"), kind=KB, subject=("b",)),
            Control("sc-plain", "detected", "crash", M("plain"), kind=SC),
        ]
    )
    assert [f.kind for f in d.failures] == [CONTROL_FAILED]


def test_a_control_recorded_by_a_pytest_test_reads_back_whole():
    """The pytest tier records a control's fields (Control.properties) and `pytest --gate` reads them back
    (Control.from_properties): the same control, kind and rule 5's subject included; a test that skipped before it
    recorded a verdict reads back as a skip of a negative control; its mode and subject read back typed."""
    c = Control(
        "n",
        "known-bad",
        "clean",
        M("plain"),
        "decoded right",
        kind=KNOWN_BAD,
        subject=("0.25.1", "eagle", "FLASH_ATTN"),
        variant=("eagle", "FLASH_ATTN"),
    )
    assert Control.from_properties("n", dict(c.properties())) == c
    assert Control.from_properties("n", {k: plain(v) for k, v in c.properties()}).variant == ("eagle", "FLASH_ATTN")
    na = Control("m", "fault", "skip", M("mig"), "", not_applicable="no MIG here", needs="mig")
    assert Control.from_properties("m", dict(na.properties())) == na
    assert Control.from_properties("k", {}) == Control("k", "clean", "skip", M("eager"), "")
    # through xdist's plain values (a tuple a list): the mode's engine audit and the subject typed again
    audit = Control("a", "audit", "stale-audit", M("audit+mps:16"), kind=KNOWN_BAD, subject=("0.25.1", "eagle"))
    assert Control.from_properties("a", {k: plain(v) for k, v in audit.properties()}) == audit


def test_a_known_bad_build_caught_with_one_method_and_clean_with_another_passes_naming_the_clean_one():
    """A defect lives on one capture path: the DFlash builder's mutant leaves EAGLE clean
    (results/h100-scenarios-mutants-0.33.0), which the gate had called HARNESS BLIND."""
    dfl, eag = ("0.33.0-dfl", "dflash", "FLASH_ATTN"), ("0.33.0-dfl", "eagle", "FLASH_ATTN")
    d = decide(
        [
            Control("kb-dflash-audit", "known-bad", "wrong-output", M("audit"), kind=KB, subject=dfl, variant=dfl[1:]),
            Control("kb-dflash-plain", "known-bad", "wrong-output", M("plain"), kind=KB, subject=dfl, variant=dfl[1:]),
            Control("kb-eagle-audit", "known-bad", "clean", M("audit"), kind=KB, subject=eag, variant=eag[1:]),
            Control("kb-eagle-plain", "known-bad", "clean", M("plain"), kind=KB, subject=eag, variant=eag[1:]),
            Control("sc-audit", "audit", "crash", M("audit"), kind=SC, variant=eag[1:]),  # eagle's path sees the bug
            Control("sc-plain", "detected", "crash", M("plain"), kind=SC, variant=eag[1:]),
        ]
    )
    assert d.passed, d.failures
    assert d.misses == [
        "kb-eagle-audit: clean (not with eagle FLASH_ATTN; detected with dflash FLASH_ATTN)",
        "kb-eagle-plain: clean (not with eagle FLASH_ATTN; detected with dflash FLASH_ATTN)",
    ]


def test_a_known_bad_build_silent_with_every_method_and_mode_fails_naming_each():
    eag, dfl = ("0.33.0-x", "eagle", "FLASH_ATTN"), ("0.33.0-x", "dflash", "FLASH_ATTN")
    d = decide(
        [
            Control("kb-eagle-plain", "known-bad", "clean", M("plain"), "decoded", kind=KB, subject=eag),
            Control("kb-dflash-plain", "known-bad", "clean", M("plain"), "decoded", kind=KB, subject=dfl),
            Control("sc-plain", "detected", "crash", M("plain"), kind=SC),
        ]
    )
    (f,) = d.failures
    assert f.kind == CONTROL_FAILED and f.case_id == "kb-eagle-plain"
    assert (
        "known-bad build 0.33.0-x showed no evidence in any of its variants and modes "
        "(eagle FLASH_ATTN plain: clean, dflash FLASH_ATTN plain: clean)"
    ) in f


def test_two_known_bad_builds_are_judged_apart():
    a, b = ("0.25.1", "eagle", "FLASH_ATTN"), ("0.24.0", "eagle", "FLASH_ATTN")
    d = decide(
        [
            Control("a-audit", "known-bad", "stale-audit", M("audit"), kind=KB, subject=a),
            Control("b-audit", "known-bad", "clean", M("audit"), kind=KB, subject=b),
            Control("b-plain", "known-bad", "clean", M("plain"), kind=KB, subject=b),
            Control("sc-plain", "detected", "crash", M("plain"), kind=SC),
        ]
    )
    assert [f.case_id for f in d.failures] == ["b-audit"]


@pytest.mark.parametrize(
    "other", [("eagle", "FLASH_ATTN"), ("dflash", "TRITON_ATTN")], ids=["another-method", "another-backend"]
)
def test_a_known_bad_builds_clean_path_that_nothing_showed_the_bug_on_fails(other):
    """Without a self control of that path (`--self-control none`), a method or backend the known-bad build leaves
    clean has no evidence that the harness could see the bug there: it fails, as before rule 5 spanned methods."""
    build = ("0.25.1",)
    caught, clean = ("dflash", "FLASH_ATTN"), other
    d = decide(
        [
            Control(
                "kb-caught-plain", "known-bad", "crash", M("plain"), kind=KB, subject=build + caught, variant=caught
            ),
            Control(
                "kb-clean-plain",
                "known-bad",
                "clean",
                M("plain"),
                "decoded",
                kind=KB,
                subject=build + clean,
                variant=clean,
            ),
        ]
    )
    (f,) = d.failures
    assert f.kind == CONTROL_FAILED and f.case_id == "kb-clean-plain"
    assert "no positive control of that path did" in f and " ".join(clean) in f
