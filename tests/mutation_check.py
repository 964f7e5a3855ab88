"""Mutation check of tests/test_vouch_rules.py, tests/test_acceptance.py, tests/test_vllm_gate.py (its outcome
tests) and tests/test_policy.py (not collected by pytest): each mutation deletes or weakens one rule in the source,
runs the set's tests, and compares the tests that failed with the ones
named for the rule (each must fail; a rule others rest on fails more); the source is restored after each run,
whatever happened.

    python tests/mutation_check.py vouch     # gate/coverage.py, gate/judge.py, gate/steps.py (annotate's checks)
    python tests/mutation_check.py reference # every reference check of gate/judge.py and gate/steps.py
    python tests/mutation_check.py outcome   # GateRun.outcome, decision, blind and judge (gate/outcome.py)
    python tests/mutation_check.py policy    # repro/judge/policy.py, decision.py; GateMode.policy_mode (gate/modes.py)
    python tests/mutation_check.py hang      # when a hang is evidence (gate/steps.py annotate, gate/process.py, classify)
    python tests/mutation_check.py steps     # the judging's declared steps and the runner of their phases (gate/steps.py)
    python tests/mutation_check.py ends      # the auditor's count decides however a case ends; library CUDA errors
    python tests/mutation_check.py why       # a CANNOT VOUCH's cause read from typed flags (gate/why.py, classify)

Exit status 1 when a mutation matched its source other than once, or a test named for it did not fail."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COV, GJ, GS, POL = (
    "repro/vllm_integration/gate/coverage.py",
    "repro/vllm_integration/gate/judge.py",
    "repro/vllm_integration/gate/steps.py",
    "repro/judge/policy.py",
)
CHANNEL = "repro/contract/channel.py"
DECISION, MODES = "repro/judge/decision.py", "repro/vllm_integration/gate/modes.py"


def _row(counter: str) -> tuple[str, str, bool]:
    """Delete the NEEDS row of this counter (a regular expression)."""
    return r"    Need\(\n(?:(?!    \),\n).)*?counter=\"" + counter + r"\".*?\n    \),\n", "", True


def _off(line: str) -> tuple[str, str, bool]:
    """An `if`/`elif` whose condition becomes False."""
    head = line[: len(line) - len(line.lstrip())] + line.strip().split(" ", 1)[0]
    return line, f"{head} False:", False


FEATURES = "test_the_features_annotate_needs_come_from_the_table"
# (rule, source, old, new, regex, the tests that must fail: function names, parameters dropped)
VOUCH = [
    (
        "not_fired: a reference is not asked",
        COV,
        "    if case.reference:\n        return []\n",
        "",
        False,
        {"test_a_reference_is_not_asked_what_fired"},
    ),
    (
        "not_fired: no engine record",
        COV,
        *_off('    if not identity or not identity.get("engine"):'),
        {"test_no_engine_record_is_said"},
    ),
    ("not_fired: V2 runner", COV, *_off('    if not e.get("model_runner_v2"):'), {"test_not_the_v2_runner"}),
    (
        "not_fired: forwards through the hooked backend",
        COV,
        *_off("    if not by_backend.get(backend):"),
        {"test_no_forward_through_the_hooked_backend"},
    ),
    ("not_fired: FA3", COV, *_off('        if set(versions) != {"3"}:'), {"test_flash_attn_must_be_fa3"}),
    ("not_fired: FULL cudagraph mode", COV, *_off("    if mode not in FULL_MODES:"), {"test_no_full_cuda_graphs"}),
    (
        "not_fired: a capture ran attention",
        COV,
        *_off('    elif not sum((c.get("captures_with_attention") or {}).values()):'),
        {"test_a_full_mode_whose_captures_ran_no_attention"},
    ),
    (
        "not_fired: speculative decoding",
        COV,
        *_off('    if not e.get("speculative_method") or not e.get("num_speculative_tokens"):'),
        {"test_no_speculative_decoding"},
    ),
    (
        "not_fired: 0 drafts",
        COV,
        *_off("        if isinstance(drafts, (int, float)) and drafts == 0:"),
        {"test_speculative_decoding_with_zero_drafts"},
    ),
    (
        "not_fired: spec layout known",
        COV,
        *_off("    if known is False:"),
        {"test_an_unknown_spec_layout"},
    ),
    (
        "NEEDS row: weights",
        COV,
        '    Need("every case", lambda case: True, "weights", in_reference=True),\n',
        "",
        False,
        {FEATURES},
    ),
    (
        "NEEDS row: probe",
        COV,
        '    Need("every case but references", lambda case: True, "probe"),',
        "",
        False,
        {FEATURES},
    ),
    # the audit feature stays in the table through its other rows (descriptor checks): only the rule's own test fails
    ("NEEDS row: audit checks", COV, *_row("checks"), {"test_audit_mode_needs_auditor_checks"}),
    (
        "NEEDS row: inject captures_injected[draft*]",
        COV,
        *_row("captures_injected"),
        {"test_a_self_control_needs_its_injection_in_a_draft_capture", FEATURES},
    ),
    (
        "NEEDS row: sm_margin sched_sm_margin",
        COV,
        *_row("sched_sm_margin"),
        {"test_sm_margin_must_reach_get_scheduler_metadata"},
    ),
    ("NEEDS row: sm_margin fwd_sm_margin", COV, *_row("fwd_sm_margin"), {"test_sm_margin_must_reach_the_fa3_forward"}),
    ("NEEDS row: poison entries_poisoned", COV, *_row("entries_poisoned"), {"test_poison_must_fill_entries", FEATURES}),
    (
        "NEEDS: the sm_margin rows hold in the reference too",
        COV,
        r"(counter=\"sched_sm_margin\",.*?)        in_reference=True,\n(.*?counter=\"fwd_sm_margin\",.*?)"
        r"        in_reference=True,\n",
        r"\1\2",
        True,
        {"test_a_reference_in_sm_margin_needs_the_margin_too", FEATURES},
    ),
    (
        "annotate: needed features from the table",
        GS,
        "    needed = features_needed(case)",
        "    needed = set()",
        False,
        {"test_annotate_refuses_a_case_without_a_feature_the_table_needs"},
    ),
    (
        "reference_problems: the reference's sm_margin",
        GJ,
        '    if case.mode.sm.kind == "sm_margin" and any(',
        "    if False and any(",
        False,
        {"test_a_reference_in_sm_margin_needs_the_margin_too"},
    ),
    (
        "vouch: a reference as it is",
        GJ,
        "    if case.reference or res.verdict in (ERROR, SKIP):",
        "    if res.verdict in (ERROR, SKIP):",
        False,
        {"test_vouch_leaves_a_reference_as_it_is"},
    ),
    (
        "vouch: a crash, a hang, wrong tokens stay evidence",
        GJ,
        "        if not case.inject or wrote and not blind:",
        "        if wrote and not blind:",
        False,
        {"test_a_crash_a_hang_or_wrong_tokens_stay_evidence"},
    ),
    (
        "vouch: ... in a self control whose injection wrote too",
        GJ,
        "        if not case.inject or wrote and not blind:",
        "        if not case.inject:",
        False,
        {"test_a_crash_a_hang_or_wrong_tokens_stay_evidence"},
    ),
    (
        "vouch: a self control whose injection never wrote",
        GJ,
        "        if not case.inject or wrote and not blind:",
        "        if True:",
        False,
        {"test_a_self_control_whose_injection_never_wrote_cannot_vouch"},
    ),
    (
        "vouch: in audit a self control's fault needs the auditor's catch",
        GJ,
        "        blind = case.mode.audit and not res.stale_fields and descriptor_check_existed(counters)",
        "        blind = False",
        False,
        {"test_in_the_audit_mode_a_self_controls_fault_alone_cannot_vouch_the_auditor_must_catch_it"},
    ),
    (
        "vouch: clean/stale-audit that did not fire",
        GJ,
        "        missing = not_fired(case, res.backend_identity)",
        "        missing = []",
        False,
        {"test_a_clean_or_stale_audit_case_that_did_not_fire_cannot_vouch"},
    ),
    (
        "channel.has: a live record missing a key is not excused as an old one",
        CHANNEL,
        '    raise MissingKey(f"{what} lacks',
        '    return False\n    raise MissingKey(f"{what} lacks',
        False,
        {
            "test_a_live_audit_record_without_the_descriptor_checks_counters_cannot_vouch",
            "test_an_unknown_spec_layout",
            "test_no_forward_through_the_hooked_backend",
        },
    ),
    (
        "vouch: only a record marked as predating the descriptor check excuses a self control's fault alone",
        COV,
        '    return "descriptor_checks" in counters or DESCRIPTOR_CHECK not in recorded_before(counters)',
        '    return "descriptor_checks" in counters',
        False,
        {"test_in_the_audit_mode_a_self_controls_fault_alone_cannot_vouch_the_auditor_must_catch_it"},
    ),
]
# every reference check (reference_problems, validate_reference, apply_reference, compare_tokens, annotate's MPS SM
# count): each deleted or weakened, the tests named must fail
REFERENCE = [
    (
        "reference_problems: a reference with CUDA graphs",
        GJ,
        *_off('        if e.get("cudagraph_mode") not in (None, "NONE"):'),
        {"test_a_reference_that_ran_with_cuda_graphs_is_not_trusted"},
    ),
    (
        "reference_problems: a speculative reference's draft acceptance",
        GJ,
        *_off("            if rate is None or rate < MIN_ACCEPTANCE:"),
        {"test_a_speculative_reference_whose_draft_is_rarely_accepted_is_not_trusted"},
    ),
    (
        "reference_problems: a live record without its configuration",
        GJ,
        *_off(
            "    if reports is None:  # a live record without the key: its worker did not check what a reference must show"
        ),
        {"test_a_live_reference_record_without_its_configuration_is_an_error_not_trusted"},
    ),
    (
        "reference_problems: an old record only by the upgrader's mark",
        GJ,
        "    return False if CONFIGURATION in recorded_before(out) else None",
        "    return False",
        False,
        {"test_a_live_reference_record_without_its_configuration_is_an_error_not_trusted"},
    ),
    (
        "reference_problems: no engine record",
        GJ,
        *_off("    if not e:"),
        {"test_a_reference_without_an_engine_record_is_not_trusted"},
    ),
    (
        "validate_reference: a broken reference is an error",
        GJ,
        '    return res.revised("reference validation", why, verdict=ERROR, reason=why, flags=flags)',
        '    return res.revised("reference validation", why, reason=why, flags=flags)',
        False,
        {
            "test_a_reference_that_ran_with_cuda_graphs_is_not_trusted",
            "test_a_live_reference_record_without_its_configuration_is_an_error_not_trusted",
        },
    ),
    (
        "apply_reference: a reference on another SM count",
        GJ,
        *_off("    if sms is not None and ref_sms is not None and sms != ref_sms:"),
        {"test_a_reference_on_another_sm_count_cannot_judge_a_case"},
    ),
    (
        "compare_tokens: the near-tie count",
        GJ,
        "                c.ties += 1\n",
        "                pass\n",
        False,
        {"test_near_ties_between_case_and_reference_are_counted_and_stop_the_request"},
    ),
    (
        "compare_tokens: a tie is below the margin, not at it",
        GJ,
        "            if m is not None and m < TIE_MARGIN:",
        "            if m is not None and m <= TIE_MARGIN:",
        False,
        {"test_near_ties_between_case_and_reference_are_counted_and_stop_the_request"},
    ),
    (
        "apply_reference: too many near ties cannot vouch",
        GJ,
        *_off("    if chk.coverage < MIN_COVERAGE and res.verdict == CLEAN:"),
        {"test_near_ties_between_case_and_reference_are_counted_and_stop_the_request"},
    ),
    (
        "reference_problems: no tokens",
        GJ,
        *_off('    if not out or not out.get("tokens"):'),
        {"test_a_reference_whose_tokens_cannot_be_ground_truth_is_not_trusted"},
    ),
    (
        "reference_problems: non-finite log-probabilities",
        GJ,
        *_off("    if nonfinite:"),
        {"test_a_reference_whose_tokens_cannot_be_ground_truth_is_not_trusted"},
    ),
    (
        "reference_problems: a position without a finite margin",
        GJ,
        *_off("    if missing and not nonfinite:"),
        {"test_a_reference_whose_tokens_cannot_be_ground_truth_is_not_trusted"},
    ),
    (
        "reference_problems: a degenerate reference",
        GJ,
        *_off("        if len(toks) >= DEGENERATE_MIN and len(set(toks[1:])) == 1:"),
        {"test_a_reference_whose_tokens_cannot_be_ground_truth_is_not_trusted"},
    ),
    (
        "apply_reference: no clean reference",
        GJ,
        *_off("    if ref.verdict != CLEAN or not ref_out or not out:"),
        {"test_a_case_without_a_clean_reference_cannot_be_compared"},
    ),
    (
        "compare_acceptance: a case without acceptance",
        GJ,
        *_off("    if acceptance_rate(want) is None or acceptance_rate(got) is None:"),
        {
            "test_a_case_without_acceptance_cannot_vouch_against_a_speculative_reference",
            "test_a_live_reference_without_acceptance_cannot_judge_a_case_that_drafted",
        },
    ),
    (
        "compare_acceptance: a live reference read as a recorded one",
        GJ,
        "acceptance_rate(got) is None or not engine or ACCEPTANCE in recorded_before(engine)",
        "acceptance_rate(got) is None or True",
        False,
        {"test_a_live_reference_without_acceptance_cannot_judge_a_case_that_drafted"},
    ),
    (
        "compare_acceptance: a drop beyond noise",
        GJ,
        *_off("    if acceptance_rate(got) < acceptance_rate(want) - ACCEPTANCE_DROP:"),
        {"test_a_drop_beyond_noise_is_a_silently_wrong_draft"},
    ),
    (
        "not_fired: a live engine record without its compilation mode",
        COV,
        *_off(
            '    if case.compile != DEFAULT_COMPILE and "compilation_mode" not in e and COMPILATION not in recorded_before(e):'
        ),
        {"test_a_live_engine_record_without_its_compilation_mode_cannot_vouch_for_compile_none"},
    ),
    (
        "annotate: MPS gave the SM count asked for",
        GS,
        *_off('    if devices and (why := mps_sm_mismatch(f.case.mode.sm, devices[-1].get("sms"))):'),
        {"test_an_mps_case_that_got_other_sms_than_it_asked_is_an_error"},
    ),
]
RUN = "repro/vllm_integration/gate/outcome.py"
# GateRun.outcome and the one stored decision every report reads (tests/test_vllm_gate.py)
OUTCOME_TEST = "test_the_gate_outcome_reads_failure_kinds_not_their_words"
OUTCOME = [
    (
        "outcome: a self control that missed is never a pass",
        RUN,
        "        return GateOutcome.BLIND if self.blind(need_control) else GateOutcome.PASS",
        "        return GateOutcome.PASS",
        False,
        {OUTCOME_TEST, "test_compare_paths_reports_the_outcome_its_exit_code_reads"},
    ),
    (
        "outcome: AFFECTED when a build under test showed the bug",
        RUN,
        *_off("        if any(r.verdict in FAULTS for _, r in affected):"),
        {"test_the_outcome_of_an_affected_build_and_of_one_that_gave_no_answer"},
    ),
    (
        "outcome: CANNOT VOUCH when a build under test gave no answer",
        RUN,
        *_off("        if affected or self.not_vouched() or self.unanswered():"),
        {"test_the_outcome_of_an_affected_build_and_of_one_that_gave_no_answer"},
    ),
    (
        "decision: --no-control drops the missing control only",
        RUN,
        *_off("        if not need_control:"),
        {OUTCOME_TEST, "test_compare_paths_reports_the_outcome_its_exit_code_reads"},
    ),
    (
        "blind: a build under test's failure is not the harness's",
        RUN,
        *_off("            if f.case_id in under:"),
        {"test_the_outcome_of_an_affected_build_and_of_one_that_gave_no_answer"},
    ),
    (
        "judge: the answer for the question asked",
        RUN,
        "GateJudgment(need_control, self.outcome(need_control), tuple(self.blind(need_control)), d)",
        "GateJudgment(need_control, self.outcome(), tuple(self.blind(need_control)), d)",
        False,
        {"test_compare_paths_reports_the_outcome_its_exit_code_reads"},
    ),
]
DECIDE_TESTS = {  # the decide tests, which rest on what counts as evidence and on a met expectation passing
    "test_a_run_whose_controls_all_showed_what_they_must_passes",
    "test_a_failed_control_fails_the_gate_with_its_case_id",
    "test_a_disagreement_is_listed_but_does_not_fail",
    "test_a_recorded_control_neither_fails_nor_counts_as_evidence",
    "test_a_control_that_cannot_exist_here_is_not_applicable",
    "test_a_required_feature_absent_fails",
    "test_a_mode_with_only_negative_controls_fails",
    "test_a_mode_whose_positive_controls_showed_nothing_fails",
    "test_evidence_is_counted_per_kind_of_control",
}
DECIDE_WITHOUT_NEGATIVE = {  # no negative control that passed in them
    "test_a_mode_whose_positive_controls_showed_nothing_fails",
    "test_evidence_is_counted_per_kind_of_control",
}
POLICY = [
    (
        "MEETS fault",
        POL,
        "    FAULT: (*MEMORY_FAULTS, LAUNCH_FAIL),",
        "    FAULT: MEMORY_FAULTS,",
        False,
        {"test_fault_is_met_by_the_kernels_failing"},
    ),
    (
        "MEETS detected",
        POL,
        "    DETECTED: KERNEL_EVIDENCE,",
        "    DETECTED: MEMORY_FAULTS,",
        False,
        {"test_detected_is_met_by_kernel_evidence"},
    ),
    (
        "MEETS audit",
        POL,
        "    AUDIT: (*KERNEL_EVIDENCE, STALE_AUDIT),",
        "    AUDIT: KERNEL_EVIDENCE,",
        False,
        {"test_audit_is_met_by_kernel_evidence_or_stale_audit"},
    ),
    (
        "MEETS clean",
        POL,
        "    EXPECT_CLEAN: (CLEAN,),",
        "    EXPECT_CLEAN: (CLEAN, STALE_AUDIT),",
        False,
        {"test_clean_is_met_by_clean_only"},
    ),
    (
        "MEETS recorded",
        POL,
        "    RECORDED: (CLEAN, *KERNEL_EVIDENCE, STALE_AUDIT),",
        "    RECORDED: (CLEAN, *KERNEL_EVIDENCE),",
        False,
        {"test_recorded_is_met_by_anything_that_ran"},
    ),
    (
        "satisfies: skip -> None",
        POL,
        "    if verdict == SKIP:\n        return None\n",
        "",
        False,
        {"test_a_skip_meets_nothing_and_fails_nothing"},
    ),
    (
        "satisfies: unknown expectation",
        POL,
        *_off("    if expect not in MEETS:"),
        {"test_an_unknown_expectation_is_refused"},
    ),
    (
        "is_positive",
        POL,
        "    return expect in (FAULT, DETECTED, AUDIT, KNOWN_BAD_BUILD, ANY_FORM)",
        "    return expect in (FAULT, DETECTED, KNOWN_BAD_BUILD, ANY_FORM)",
        False,
        {"test_fault_detected_and_audit_are_the_positive_expectations"},
    ),
    (
        "counts_as_evidence: kernel evidence",
        POL,
        "    return verdict in KERNEL_EVIDENCE or (",
        "    return False or (",
        False,
        {"test_kernel_evidence_counts_in_every_mode", *DECIDE_TESTS},
    ),
    (
        "counts_as_evidence: stale-audit in the engine audit mode",
        POL,
        " or (verdict == STALE_AUDIT and mode.engine_audit)",
        "",
        False,
        {"test_stale_audit_counts_only_in_the_engine_audit_mode"},
    ),
    (
        "counts_as_evidence: ... only there",
        POL,
        "(verdict == STALE_AUDIT and mode.engine_audit)",
        "(verdict == STALE_AUDIT)",
        False,
        {"test_stale_audit_counts_only_in_the_engine_audit_mode"},
    ),
    (
        "GateMode.parse: the auditor in an SM configuration",
        MODES,
        'return cls(f"audit+{inner.name}", audit=True, sm=inner.sm)',
        'return cls(f"audit+{inner.name}", audit=False, sm=inner.sm)',
        False,
        {"test_stale_audit_counts_only_in_the_engine_audit_mode"},
    ),
    (
        "GateMode.policy_mode: the auditor's stale-audit is the engine's",
        MODES,
        "return GatingMode(self.name, engine_audit=self.audit)",
        "return GatingMode(self.name)",
        False,
        {"test_stale_audit_counts_only_in_the_engine_audit_mode"},
    ),
    (
        "parse_requirements: an unknown one",
        POL,
        *_off("    if unknown:"),
        {"test_requirements_are_parsed_and_an_unknown_one_refused"},
    ),
    (
        "disagrees: positive controls only",
        POL,
        "    return is_positive(expect) and verdict in KERNEL_EVIDENCE and not satisfies(expect, verdict)",
        "    return verdict in KERNEL_EVIDENCE and not satisfies(expect, verdict)",
        False,
        {"test_another_kind_of_kernel_evidence_is_a_disagreement"},
    ),
    (
        "disagrees: another kind only",
        POL,
        "    return is_positive(expect) and verdict in KERNEL_EVIDENCE and not satisfies(expect, verdict)",
        "    return is_positive(expect) and verdict in KERNEL_EVIDENCE",
        False,
        {"test_another_kind_of_kernel_evidence_is_a_disagreement"},
    ),
    (
        "problem: no evidence",
        POL,
        *_off("    if verdict in NO_EVIDENCE:"),
        {"test_a_control_without_evidence_fails_whatever_it_expected"},
    ),
    (
        "problem: a met expectation passes",
        POL,
        "    if satisfies(expect, verdict) or (",
        "    if False or (",
        False,
        {"test_a_control_that_meets_its_expectation_passes", *DECIDE_TESTS} - DECIDE_WITHOUT_NEGATIVE,
    ),
    (
        "problem: a positive control with any kernel evidence passes",
        POL,
        "    if satisfies(expect, verdict) or (is_positive(expect) and verdict in KERNEL_EVIDENCE):",
        "    if satisfies(expect, verdict):",
        False,
        {"test_a_positive_control_passes_with_any_kernel_evidence", "test_a_disagreement_is_listed_but_does_not_fail"},
    ),
    (
        "problem: a negative control's words",
        POL,
        *_off("    if expect == EXPECT_CLEAN:"),
        {"test_a_negative_control_that_is_not_clean_fails"},
    ),
    (
        "problem: a positive control's words",
        POL,
        ", expected {expect} ({', '.join(MEETS[expect])})",
        "",
        False,
        {"test_a_positive_control_without_evidence_fails_saying_what_it_expected"},
    ),
    (
        "decide: a required feature absent",
        POL,
        *_off("            if c.needs and c.needs in required:"),
        {"test_a_required_feature_absent_fails"},
    ),
    (
        "decide: not applicable",
        POL,
        "            d.not_applicable.append((c.case_id, c.not_applicable))\n",
        "            pass\n",
        False,
        {"test_a_control_that_cannot_exist_here_is_not_applicable"},
    ),
    (
        "decide: a failed control",
        POL,
        "        if c.gating and (why := problem(c.expected, c.verdict)):",
        "        if False and (why := problem(c.expected, c.verdict)):",
        False,
        {"test_a_failed_control_fails_the_gate_with_its_case_id"},
    ),
    (
        "decide: a recorded control does not gate",
        POL,
        "        if c.gating and (why := problem(c.expected, c.verdict)):",
        "        if (why := problem(c.expected, c.verdict)):",
        False,
        {"test_a_recorded_control_neither_fails_nor_counts_as_evidence"},
    ),
    (
        "decide: a disagreement",
        POL,
        *_off("        elif c.gating and disagrees(c.expected, c.verdict):"),
        {"test_a_disagreement_is_listed_but_does_not_fail"},
    ),
    (
        "decide: a recorded control is no mode's evidence",
        POL,
        "        if c.gating:\n            modes.setdefault",
        "        if True:\n            modes.setdefault",
        False,
        {"test_a_recorded_control_neither_fails_nor_counts_as_evidence"},
    ),
    (
        "decide: a mode without a positive control",
        POL,
        *_off("        if not pos:"),
        {"test_a_mode_with_only_negative_controls_fails"},
    ),
    (
        "decide: a mode without evidence",
        POL,
        *_off("        elif not ev:"),
        {"test_a_mode_whose_positive_controls_showed_nothing_fails"},
    ),
    (
        "decide: ... the engine audit mode names the audit",
        POL,
        '" or the engine\'s audit" if modes[mode].engine_audit else ""',
        '""',
        False,
        {"test_a_mode_whose_positive_controls_showed_nothing_fails"},
    ),
    (
        "decide: no positive control at all",
        POL,
        *_off("    if not any(pos for pos, _ in d.evidence.values()):"),
        {"test_a_run_without_any_positive_control_fails"},
    ),
    (
        "decide: evidence per kind",
        POL,
        *_off("                if c.kind is not None:"),
        {"test_evidence_is_counted_per_kind_of_control"},
    ),
    (
        "rule 5: one mode's miss of a known-bad build is decided over its modes",
        POL,
        *_off("    if expect == KNOWN_BAD_BUILD:"),
        {
            "test_known_bad_is_met_by_kernel_evidence_or_the_engine_audit",
            "test_a_known_bad_build_silent_in_one_mode_but_caught_in_another_is_a_listed_miss",
            "test_a_known_bad_build_silent_in_every_mode_fails_naming_its_modes",
        },
    ),
    (
        "rule 5: a known-bad build silent in every mode fails",
        POL,
        *_off("        if silent and not shown:"),
        {"test_a_known_bad_build_silent_in_every_mode_fails_naming_its_modes"},
    ),
    (
        "rule 5: the miss is listed",
        POL,
        *_off("            if own:"),
        {"test_a_known_bad_build_silent_in_one_mode_but_caught_in_another_is_a_listed_miss"},
    ),
    (
        "rule 5: a path no control showed the bug on fails",
        POL,
        *_off(
            "            elif c.variant is not None and c.variant not in seen:  # nothing showed the bug on this path"
        ),
        {"test_a_known_bad_builds_clean_path_that_nothing_showed_the_bug_on_fails"},
    ),
    (
        "rule 6: a self control's form is decided over the forms of its mode",
        POL,
        *_off("    if expect == ANY_FORM:"),
        {
            "test_any_form_is_met_by_kernel_evidence_and_judged_over_the_forms_of_its_mode",
            "test_a_self_control_form_silent_beside_a_caught_form_is_a_listed_miss",
        },
    ),
    (
        "rule 6: a self control silent in every form of a mode fails",
        POL,
        *_off("        if not shown:"),
        {"test_a_self_control_silent_in_every_form_of_a_mode_fails_naming_its_forms"},
    ),
    (
        "rule 6: the silent form is listed",
        POL,
        "            d.form_misses += [",
        "            d.form_misses += [] and [",
        False,
        {"test_a_self_control_form_silent_beside_a_caught_form_is_a_listed_miss"},
    ),
    (
        "rule 6: forms grouped per subject",
        POL,
        "                forms.setdefault(c.subject or (c.case_id,), []).append(c)",
        "                forms.setdefault((c.mode.name,), []).append(c)",
        False,
        {"test_forms_are_judged_per_subject_not_across_modes_or_methods"},
    ),
    (
        "summary: kinds only beside known-bad",
        DECISION,
        *_off("            if set(kinds) <= {KNOWN_BAD}:"),
        {"test_the_summary_names_the_kinds_only_where_there_is_more_than_known_bad"},
    ),
    (
        "summary: not applicable by reason",
        DECISION,
        '            lines.append(f"  not applicable ({len(cases)}): {why}")\n',
        "            pass\n",
        False,
        {"test_the_summary_groups_not_applicable_cases_by_reason"},
    ),
]
GP = "repro/vllm_integration/gate/process.py"
# when a hang is a control's evidence: once vLLM's output showed its captures begun (steps.annotate, process's flag);
# a timeout before them neither ends a self control's attempts nor survives a deadline's cut as an error
HANG_RULES = [
    (
        "annotate: a hang before the captures is an error",
        GS,
        *_off('    if res.verdict == HANG and not {STALLED, CAPTURING} & set(res.flags) and not f.audit["stale"]:'),
        {"test_a_hang_counts_as_evidence_only_once_the_captures_had_begun"},
    ),
    (
        "classify: vLLM's capture line sets CAPTURING",
        "repro/judge/classify.py",
        *_off("        if spec.begun_marker and spec.begun_marker in output:"),
        {"test_a_hang_counts_as_evidence_only_once_the_captures_had_begun"},
    ),
    (
        "run_control: a timeout before the captures is no evidence",
        GP,
        "            return not (res.verdict == ERROR and was_hang(res))",
        "            return True",
        False,
        {"test_a_timeout_before_the_captures_is_no_evidence_and_the_attempts_go_on"},
    ),
    (
        "past_deadline: a hang whatever annotate made of it",
        GP,
        "    if not was_hang(res) or STALLED in res.flags:",
        "    if res.verdict != HANG or STALLED in res.flags:",
        False,
        {"test_a_deadline_cut_is_a_skip_whatever_annotate_made_of_the_hang"},
    ),
]

# the judging's declared steps (gate/steps.py): their order, the phase runner's rules, a step removed
STEPS_RULES = [
    (
        "judged: the first finding of a process decides",
        GS,
        "        if new.verdict == SKIP or (step.ends and new is not res):",
        "        if new.verdict == SKIP:",
        False,
        {"test_the_first_finding_of_a_process_decides_and_a_skip_is_judged_no_further"},
    ),
    (
        "judged: a skip is judged no further",
        GS,
        "        if new.verdict == SKIP or (step.ends and new is not res):",
        "        if step.ends and new is not res:",
        False,
        {"test_the_first_finding_of_a_process_decides_and_a_skip_is_judged_no_further"},
    ),
    (
        "acceptance_check: only after a comparison that found nothing wrong",
        GS,
        "    judged = res.verdict in (CLEAN, STALE_AUDIT) and not ended_without_result(res)",
        "    judged = True",
        False,
        {"test_a_draft_is_not_judged_once_the_tokens_were_wrong"},
    ),
    (
        "STEPS: coverage before the comparison",
        GS,
        r"(    Step\(\n        \"reference comparison\",.*?\n    \),\n)(.*?)"
        r"(    Step\(\"coverage\".*?\),\n)",
        r"\3\1\2",
        True,
        {
            "test_a_cases_history_shows_the_declared_steps_in_their_order",
            "test_the_gates_judging_is_the_declared_list_of_steps_the_doc_lists_in_its_order",
        },
    ),
    (
        "STEPS: the draft's acceptance removed",
        GS,
        '    Step("draft acceptance", KNOWN, acceptance_check, "the draft\'s acceptance against the reference\'s"),\n',
        "",
        False,
        {
            "test_a_cases_history_shows_the_declared_steps_in_their_order",
            "test_the_gates_judging_is_the_declared_list_of_steps_the_doc_lists_in_its_order",
            "test_every_step_a_gate_history_names_is_a_declared_step_or_one_of_the_runs_the_doc_names",
        },
    ),
    (
        "STEPS: the MPS SM count after the platform check",
        GS,
        r'(    Step\("MPS SM count".*?\n)(    Step\(PLATFORM_CHECK.*?\n)',
        r"\2\1",
        True,
        {
            "test_of_two_findings_in_one_process_the_earlier_check_in_steps_decides",
            "test_the_gates_judging_is_the_declared_list_of_steps_the_doc_lists_in_its_order",
        },
    ),
    (
        "STEPS: the platform check after the hang before capture",
        GS,
        r"(    Step\(PLATFORM_CHECK.*?\n)(    Step\(HUNG_EARLY.*?\n)",
        r"\2\1",
        True,
        {
            "test_of_two_findings_in_one_process_the_earlier_check_in_steps_decides",
            "test_the_gates_judging_is_the_declared_list_of_steps_the_doc_lists_in_its_order",
        },
    ),
    (
        "STEPS: the hang before capture after the audit",
        GS,
        r'(    Step\(HUNG_EARLY.*?\n)(    Step\("audit".*?\n)',
        r"\2\1",
        True,
        # a hang with a count is no hang before capture (hang_check reads the count): only the listing's order shows
        {"test_the_gates_judging_is_the_declared_list_of_steps_the_doc_lists_in_its_order"},
    ),
]

CL = "repro/judge/classify.py"
ENDS_TEST = "test_a_self_control_the_auditor_counted_is_caught_however_its_process_ends"
ENDS_BUILD = "test_a_build_the_auditor_counted_stale_is_affected_however_its_process_ends"
# the auditor's count decides an audit case however its process ended; a CUDA error through any library is a crash
ENDS_RULES = [
    (
        "audit_check: an error with a count becomes stale-audit",
        GS,
        *_off('    if res.verdict == ERROR and audit["stale"]:'),
        {ENDS_TEST, ENDS_BUILD, "test_a_process_that_ended_without_a_result_says_how_beside_the_count"},
    ),
    (
        "hang_check: a hang with a count is no hang before capture",
        GS,
        ' and not f.audit["stale"]:',
        ":",
        False,
        {ENDS_TEST, ENDS_BUILD, "test_a_hang_with_a_count_is_not_a_hang_before_capture"},
    ),
    (
        "vouch: a count before an early end is evidence as a fault is",
        GJ,
        "    if res.verdict not in (CLEAN, STALE_AUDIT) or ended_without_result(res):\n",
        "    if res.verdict not in (CLEAN, STALE_AUDIT):\n",
        False,
        {ENDS_TEST},
    ),
    (
        "apply_reference: no tokens to compare after an early end",
        GJ,
        " or ended_without_result(res):  # no tokens",
        ":  # no tokens",
        False,
        {ENDS_TEST, ENDS_BUILD},
    ),
    (
        "ended_without_result: classify's first verdict decides",
        GJ,
        "    return first not in (CLEAN, STALE_AUDIT)",
        "    return False",
        False,
        {ENDS_TEST, ENDS_BUILD},
    ),
    (
        "classify: cuBLAS's execution failure is a fault",
        CL,
        '    "CUBLAS_STATUS_EXECUTION_FAILED",\n',
        "",
        False,
        {"test_a_cuda_error_reported_through_any_library_is_a_crash_quoted_whole"},
    ),
    (
        "classify: cuDNN's execution failure is a fault",
        CL,
        '    "CUDNN_STATUS_EXECUTION_FAILED",\n',
        "",
        False,
        {"test_a_cuda_error_reported_through_any_library_is_a_crash_quoted_whole"},
    ),
    (
        "classify: a fault line quoted whole",
        CL,
        "    return line if len(line) <= QUOTE_MAX else",
        "    return line[:200] if len(line) <= QUOTE_MAX else",
        False,
        {"test_a_cuda_error_reported_through_any_library_is_a_crash_quoted_whole"},
    ),
]

WHY = "repro/vllm_integration/gate/why.py"
WHY_FLAG = "test_an_untrusted_reference_and_its_cases_carry_the_flag_their_cause_is_read_from"
# why a run cannot vouch rests on typed flags: each made where its fact is known, read by gate.why, never reworded away
WHY_RULES = [
    (
        "validate_reference: an untrusted reference carries no flag",
        GJ,
        "    flags = [*res.flags, UNTRUSTED_REFERENCE]",
        "    flags = list(res.flags)",
        False,
        {WHY_FLAG, "test_an_untrusted_reference_reworded_is_still_the_cause"},
    ),
    (
        "apply_reference: a case judged against an unusable reference carries none of its flags",
        GJ,
        "        carried = [f for f in ref.flags if f in CARRIED_FROM_REFERENCE and f not in res.flags]",
        "        carried = []",
        False,
        {WHY_FLAG, "test_a_case_judged_against_a_reference_with_a_cuda_error_has_the_references_cause"},
    ),
    (
        "classify: a CUDA error in the quoted line sets no flag",
        CL,
        *_off("        if any(m in line for m in CUDA_MARKERS):"),
        {"test_a_cuda_error_is_the_flag_classify_sets_from_the_line_it_quotes"},
    ),
    (
        "why: the untrusted reference's flag is not read",
        WHY,
        *_off(
            "    if UNTRUSTED_REFERENCE in res.flags:  # a reference its validation did not trust, or a case judged against one"
        ),
        {WHY_FLAG, "test_cannot_vouch_names_an_untrusted_reference_and_where"},
    ),
    (
        "why: the CUDA error's flag is not read",
        WHY,
        "        return CUDA if CUDA_ERROR in res.flags else NO_RESULT",
        "        return NO_RESULT",
        False,
        {"test_a_cuda_error_is_the_flag_classify_sets_from_the_line_it_quotes"},
    ),
]

SETS = {
    "ends": ("tests/test_audit_count_decides_however_a_case_ends.py tests/test_vouch_rules.py", ENDS_RULES),
    "hang": ("tests/test_stall.py tests/test_vllm_selfcontrol_attempts.py", HANG_RULES),
    "vouch": ("tests/test_vouch_rules.py", VOUCH),
    "reference": ("tests/test_vouch_rules.py tests/test_acceptance.py", REFERENCE),
    "outcome": ("tests/test_vllm_gate.py -k outcome", OUTCOME),
    "policy": ("tests/test_policy.py", POLICY),
    "steps": ("tests/test_vouch_rules.py tests/test_architecture_claims.py", STEPS_RULES),
    "why": ("tests/test_why_reads_typed_flags_never_reasons.py tests/test_reports_say_why.py", WHY_RULES),
}


def main(which: str) -> int:
    if which not in SETS:  # --help, or a set that does not exist: the usage, no mutation made
        print(__doc__.split("\n\n")[1], file=sys.stderr)
        return 0 if which in ("-h", "--help") else 2
    test_file, mutations = SETS[which]
    bad = 0
    for name, rel, old, new, regex, want in mutations:
        path = ROOT / rel
        src = path.read_text()
        mutated, n = re.subn(old, new, src, flags=re.S) if regex else (src.replace(old, new), src.count(old))
        if n != 1:
            print(f"BAD  {name}: the mutation matched {n} times")
            bad += 1
            continue
        path.write_text(mutated)
        try:
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", *test_file.split()]
            run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        finally:
            path.write_text(src)
        out = run.stdout
        if run.returncode not in (0, 1):  # not a test failure: the mutated source did not import, or pytest broke
            print(f"BAD  {name}: pytest exited {run.returncode}: {out.strip().splitlines()[-1:]}")
            bad += 1
            continue
        failed = {
            line.split()[1].split("::", 1)[1].split("[")[0]
            for line in out.splitlines()
            if line.startswith(("FAILED", "ERROR"))
        }
        ok = want <= failed  # the tests named for the rule fail (a rule others depend on fails more)
        bad += not ok
        print(f"{'ok  ' if ok else 'BAD '} {name} -> {', '.join(sorted(failed)) or 'nothing failed'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "vouch"))
