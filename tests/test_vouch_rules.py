"""One test per rule of what a vLLM gate case must show fired before it vouches (repro.vllm_integration.gate.coverage:
the rows of NEEDS, the engine checks of not_fired) and per exception of gate_judge.vouch (a crash, a hang or wrong
tokens stay evidence; a self control whose injection never wrote before one cannot vouch). Each starts from a case
in which everything fired (FIRED), takes away the one thing its rule reads, and asserts that rule's reason, and only
it, comes back.

Mutation-checked: for each rule, the rule was deleted from its module (a row of NEEDS, an `if` of not_fired or
vouch made False, the reference check of reference_problems), this file was run, exactly the test named for the
rule failed, and the source was restored. tests/mutation_check.py holds the 26 mutations and the tests each must
fail, and runs them (`python tests/mutation_check.py vouch`). A row of NEEDS is one rule with two consequences:
deleting it fails its counter's test and its feature's case of test_the_features_annotate_needs_come_from_the_table
(the sm_margin rows share the feature fa3, so deleting one fails its counter's test only). The reference early return
of vouch is redundant for a reference made by reference_for (nothing injected, so a crash stays evidence anyway):
its test builds a reference that carries an injection to see it.

The reference checks (reference_problems, validate_reference, apply_reference's SM count and near ties,
compare_tokens, compare_acceptance, annotate's MPS SM count) and the live-record rules are the tests at the end of
this file; `python tests/mutation_check.py reference` deletes each of those 19 rules in turn and names the test that
must fail (with tests/test_acceptance.py). The judging's declared steps (gate.steps.STEPS: their order in a history,
the first finding of a process deciding, a skip judged no further) are tested beside them; `python
tests/mutation_check.py steps` moves or removes a step and weakens each rule of the runner of their phases."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import pytest

from repro.case.spec import PLATFORM_FAILED, CaseResult
from repro.contract import channel
from repro.contract.channel import RECORDED_BEFORE
from repro.contract.verdicts import CANNOT_VOUCH, CLEAN, CRASH, ERROR, HANG, STALE_AUDIT, WRONG
from repro.report.records import upgrade_result
from repro.vllm_integration.gate import coverage
from repro.vllm_integration.gate import judge as gate_judge
from repro.vllm_integration.gate import steps as gate_steps
from repro.vllm_integration.gate.case import GateCase, reference_for
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.plugin.inject import STALE_CAPTURE
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

BUILD = VllmBuild("x", None, UNDER_TEST, "0.26.0")
FIRED = {  # everything every mode needs, counted
    "engine": {
        "model_runner": "vllm.v1.worker.gpu.model_runner.GPUModelRunner",
        "model_runner_v2": True,
        "attention_backend_requested": "FLASH_ATTN",
        "cudagraph_mode": "FULL_AND_PIECEWISE",
        "speculative_method": "eagle",
        "num_speculative_tokens": 3,
    },
    "counters": {
        "backends": {"FLASH_ATTN": 40},
        "fa_versions": {"3": 40},
        "captures_with_attention": {"target FULL": 4, "draft FULL": 4},
        "spec_layout": "v2-eagle",
        "spec_layout_known": True,
        "checks": 12,
        "descriptor_checks": {"draft decode": 4},
        "descriptor_unchecked": {},
        "captures_injected": {"draft FULL": 2},
        "inject_writes": {"draft build": 2},
        "sched_calls": 9,
        "sched_sm_margin": 9,
        "fwd_sm_margin": 30,
        "entries_poisoned": 64,
    },
    "acceptance": {"spec_decode_num_drafts": 20},
    "injection": [{"injection_wrote": "draft build"}],
}


def case(mode: str = "plain", inject: bool = False, backend: str = "FLASH_ATTN") -> GateCase:
    return GateCase(BUILD, GateMode.parse(mode), backend=backend, inject=STALE_CAPTURE if inject else None)


def identity(engine: dict | None = None, counters: dict | None = None, **top) -> dict:
    """FIRED with some engine keys and counters replaced (a value of None removes the key)."""
    d = copy.deepcopy(FIRED)
    for part, changes in (("engine", engine or {}), ("counters", counters or {})):
        d[part] = {k: v for k, v in {**d[part], **changes}.items() if v is not None}
    d.update(top)
    return d


MODES = ("plain", "audit", "mps:16", "sm_margin:16", "poison:int-max")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("inject", [False, True], ids=["build", "self-control"])
def test_a_case_in_which_everything_fired_vouches(mode, inject):
    c = case(mode, inject)
    assert coverage.not_fired(c, identity()) == []
    res = CaseResult(c.case_id, CLEAN, "tokens equal", backend_identity=identity())
    assert gate_judge.vouch(c, res) is res


def only(c: GateCase, ident: dict) -> str:
    missing = coverage.not_fired(c, ident)
    assert len(missing) == 1, missing
    return missing[0]


# -- not_fired: the engine checks (coverage.ENGINE_CHECKS) --


def test_a_reference_is_not_asked_what_fired():
    assert coverage.not_fired(reference_for(case("audit")), None) == []


def test_no_engine_record_is_said():
    assert coverage.not_fired(case(), None) == [
        "the case process reported no engine configuration and no counters (no REPRO_ENGINE line)"
    ]


def test_not_the_v2_runner():
    why = only(case(), identity(engine={"model_runner_v2": False, "model_runner": "GPUModelRunnerV1"}))
    assert why == "not the V2 model runner (runner: GPUModelRunnerV1)"


def test_no_forward_through_the_hooked_backend():
    why = only(case(), identity(counters={"backends": {"FLASHINFER": 40}}))
    assert why.startswith("no attention forward went through the hooked FLASH_ATTN impl (forwards counted per")
    assert "FLASHINFER 40" in why
    # records from before the per-backend count, as the replays' upgrader marks them: attention_forwards is FLASH_ATTN's
    old = {"backends": None, "attention_forwards": 40, RECORDED_BEFORE: [channel.BACKENDS]}
    assert coverage.not_fired(case(), identity(counters=old)) == []
    legacy = identity(counters={**old, "attention_forwards": 0})
    assert only(case(), legacy).startswith("no attention forward went through the hooked FLASH_ATTN impl")
    # a live record without the per-backend count: not read as an old one's attention_forwards
    live = coverage.not_fired(case(), identity(counters={"backends": None, "attention_forwards": 40}))
    assert live[0].startswith("the counters record lacks 'backends'") and "no attention forward went through" in live[1]


def test_flash_attn_must_be_fa3():
    assert only(case(), identity(counters={"fa_versions": {"2": 40}})) == "FlashAttention version 2, not FA3"
    # another backend has no FA version to check
    other = identity(counters={"backends": {"TRITON_ATTN": 40}, "fa_versions": {}})
    assert coverage.not_fired(case(backend="TRITON_ATTN"), other) == []


def test_no_full_cuda_graphs():
    why = only(case(), identity(engine={"cudagraph_mode": "PIECEWISE"}))
    assert why == "cudagraph mode PIECEWISE: no FULL CUDA graphs"


def test_compile_none_must_reach_the_engine():
    c = replace(case(), compile="none")
    why = only(c, identity(engine={"compilation_mode": "VLLM_COMPILE"}))
    assert why == "--compile none asked for no torch.compile, but the engine's compilation mode is VLLM_COMPILE"
    assert coverage.not_fired(c, identity(engine={"compilation_mode": "NONE", "cudagraph_mode": "FULL"})) == []
    assert coverage.not_fired(case(), identity(engine={"compilation_mode": "VLLM_COMPILE"})) == []


def test_a_full_mode_whose_captures_ran_no_attention():
    why = only(case(), identity(counters={"captures_with_attention": {}}))
    assert why == (
        "cudagraph mode FULL_AND_PIECEWISE, but no CUDA graph capture ran an attention forward (no FULL graph seen)"
    )


def test_no_speculative_decoding():
    why = only(case(), identity(engine={"speculative_method": None}))
    assert why == "no speculative decoding (method None, k 3)"


def test_speculative_decoding_with_zero_drafts():
    why = only(case(), identity(acceptance={"spec_decode_num_drafts": 0}))
    assert why == "speculative decoding configured, but vLLM counted 0 drafts"


def test_an_unknown_spec_layout():
    why = only(case(), identity(counters={"spec_layout_known": False, "spec_layout": "v3"}))
    assert why == "speculative-decoding layout v3 is not one the auditor knows (plugin.KNOWN_SPEC_LAYOUTS)"
    old = identity(counters={"spec_layout_known": None, RECORDED_BEFORE: [channel.SPEC_LAYOUT]})
    assert coverage.not_fired(case(), old) == []  # a recorded run from before the key, as the upgrader marks it
    assert only(case(), identity(counters={"spec_layout_known": None})).startswith(
        "the counters record lacks 'spec_layout_known' (a live record"
    )


# -- not_fired: the rows of coverage.NEEDS --


def test_audit_mode_needs_auditor_checks():
    assert only(case("audit"), identity(counters={"checks": 0})) == "the freshness auditor made 0 checks"
    assert coverage.not_fired(case("plain"), identity(counters={"checks": 0})) == []


def test_a_self_control_needs_its_injection_in_a_draft_capture():
    target_only = identity(counters={"captures_injected": {"target FULL": 3}, "inject_snapshots": 1})
    why = only(case(inject=True), target_only)
    assert why.startswith("the self control's injection reached no draft FULL capture (writes draft build 2; target")
    assert why.endswith("this layout or backend keeps the draft's capture out of its reach")
    assert coverage.not_fired(case(), target_only) == []


def test_sm_margin_must_reach_get_scheduler_metadata():
    why = only(case("sm_margin:16"), identity(counters={"sched_sm_margin": 0}))
    assert why == "no get_scheduler_metadata call received the injected sm_margin"


def test_sm_margin_must_reach_the_fa3_forward():
    why = only(case("sm_margin:16"), identity(counters={"fwd_sm_margin": 0}))
    assert why == "no FA3 forward (torch.ops._vllm_fa3_C.fwd) received the injected sm_margin"


def test_poison_must_fill_entries():
    why = only(case("poison:int-max"), identity(counters={"entries_poisoned": 0}))
    assert why == "0 scheduler-metadata entries poisoned (9 get_scheduler_metadata calls seen)"
    assert coverage.not_fired(case("plain"), identity(counters={"entries_poisoned": 0})) == []


def test_a_reference_in_sm_margin_needs_the_margin_too():
    ref = reference_for(case("sm_margin:16"))
    ident = {"engine": GOOD_REF_ENGINE, "counters": {}, "acceptance": GOOD_REF_ACCEPTANCE}
    res = CaseResult(ref.case_id, CLEAN, "", backend_identity=ident)
    out = {"tokens": [[1, 2, 3]], "margins": [[5.0, 5.0, 5.0]], "nonfinite": []}
    assert gate_judge.reference_problems(ref, res, out) == [
        "the reference's SM configuration sm_margin:16 did not reach FA3 (0 get_scheduler_metadata and 0 forward "
        "calls received the margin)"
    ]


@pytest.mark.parametrize(
    "c,want",
    [
        (case("plain"), {"weights", "probe"}),
        (case("audit"), {"weights", "probe", "audit"}),
        (case("sm_margin:16"), {"weights", "probe", "fa3"}),
        (case("poison:int-max"), {"weights", "probe", "fa3"}),
        (case("plain", inject=True), {"weights", "probe", "inject"}),
        (reference_for(case("audit")), {"weights"}),
        (reference_for(case("sm_margin:16")), {"weights", "fa3"}),
    ],
    ids=["plain", "audit", "sm_margin", "poison", "self-control", "reference", "reference-sm_margin"],
)
def test_the_features_annotate_needs_come_from_the_table(c, want):
    assert coverage.features_needed(c) == want


def test_annotate_refuses_a_case_without_a_feature_the_table_needs(monkeypatch):
    monkeypatch.setattr(gate_steps, "features_needed", lambda case: {"weights", "probe", "zeta"})  # any row's
    c = case("audit")
    out = "\n".join(
        [
            'REPRO_PLUGIN {"installed": "probe"}',
            'REPRO_PLUGIN {"installed": "weights"}',
            'REPRO_RESULT {"tokens": [[1]], "summary": "1 request"}',
        ]
    )
    got = gate_steps.annotate(CaseResult(c.case_id, CLEAN, "ran"), c, out, None)
    assert got.verdict == ERROR and got.reason.startswith("plugin features ['zeta'] not installed"), got.reason


def test_a_case_stopped_before_vllm_loaded_its_plugins_is_not_told_the_plugin_is_missing():
    # results/h200-initcheck-own-nofill: memcheck:own's allocator installed itself, then the process ran out of its
    # timeout inside torch before vLLM loaded any plugin; an error that says so, not "pip install the plugin"
    c = case("plain")
    out = 'REPRO_PLUGIN {"installed": "own_allocator"}'
    got = gate_steps.annotate(CaseResult(c.case_id, HANG, "no exit within 240 s", evidence="timeout"), c, out, None)
    assert got.verdict == ERROR and got.reason.startswith("the process was stopped before vLLM loaded"), got.reason
    assert "no exit within 240 s" in got.reason  # the case's own verdict stays in the reason
    # the same process with a result (it got past the engine's start) lacks the plugin indeed
    out += '\nREPRO_RESULT {"tokens": [[1]], "summary": "1 request"}'
    got = gate_steps.annotate(CaseResult(c.case_id, HANG, "no exit within 240 s", evidence="timeout"), c, out, None)
    assert got.reason.startswith("plugin features ['probe', 'weights'] not installed"), got.reason
    # a hang after vLLM loaded the plugin (one of its features installed) is not "stopped before" it either
    out = 'REPRO_PLUGIN {"installed": "own_allocator"}\nREPRO_PLUGIN {"installed": "probe"}'
    got = gate_steps.annotate(CaseResult(c.case_id, HANG, "no exit within 240 s", evidence="timeout"), c, out, None)
    assert got.reason.startswith("plugin features ['weights'] not installed"), got.reason


# -- vouch --


@pytest.mark.parametrize("verdict", [CLEAN, STALE_AUDIT])
def test_a_clean_or_stale_audit_case_that_did_not_fire_cannot_vouch(monkeypatch, verdict):
    monkeypatch.setattr(gate_judge, "not_fired", lambda case, identity: ["X did not fire", "nor Y"])  # any rule's
    c = case("audit")
    res = CaseResult(c.case_id, verdict, "the run's reason", backend_identity=identity())
    got = gate_judge.vouch(c, res)
    assert got.verdict == CANNOT_VOUCH
    assert got.reason == f"X did not fire; nor Y (case verdict would have been {verdict}: the run's reason)"
    assert got.history[-1]["step"] == "coverage"


@pytest.mark.parametrize("verdict", [CRASH, HANG, WRONG])
def test_a_crash_a_hang_or_wrong_tokens_stay_evidence(verdict):
    """Whatever did not fire: the case showed the bug. A self control whose injection wrote: the same."""
    for c, ident in ((case("audit"), None), (case(inject=True), {"injection": [{"injection_wrote": "draft build"}]})):
        res = CaseResult(c.case_id, verdict, "it faulted", backend_identity=ident)
        assert gate_judge.vouch(c, res) is res


@pytest.mark.parametrize("verdict", [CRASH, HANG, WRONG])
def test_a_self_control_whose_injection_never_wrote_cannot_vouch(verdict):
    c = case(inject=True)
    res = CaseResult(c.case_id, verdict, "it faulted", backend_identity=identity(injection=[]))
    got = gate_judge.vouch(c, res)
    assert got.verdict == CANNOT_VOUCH
    assert got.reason.startswith(
        f"the self control's injection never wrote before this {verdict}: not the re-created defect's (case verdict"
    )


@pytest.mark.parametrize("verdict", [CRASH, HANG, WRONG])
def test_in_the_audit_mode_a_self_controls_fault_alone_cannot_vouch_the_auditor_must_catch_it(verdict):
    """In audit mode each injection form must be caught by the auditor's own contents check, not only by a
    fault; a build with the descriptor check that saw no stale field is cannot-vouch. A record from before the
    descriptor check (no descriptor_checks counter) keeps its fault."""
    c = case("audit", inject=True)
    res = CaseResult(c.case_id, verdict, "it faulted", backend_identity=identity(counters={"descriptor_checks": 12}))
    got = gate_judge.vouch(c, res)
    assert got.verdict == CANNOT_VOUCH
    assert got.reason.startswith(f"the auditor caught nothing of the re-created defect (stale-capture): the {verdict}")
    caught = replace(res, stale_fields={"seq_lens": 3})
    assert gate_judge.vouch(c, caught) is caught
    old = {"descriptor_checks": None, RECORDED_BEFORE: [channel.DESCRIPTOR_CHECK]}  # as the upgrader marks it
    before = CaseResult(c.case_id, verdict, "", backend_identity=identity(counters=old))
    assert gate_judge.vouch(c, before) is before
    live = replace(before, backend_identity=identity(counters={"descriptor_checks": None}))
    assert gate_judge.vouch(c, live).verdict == CANNOT_VOUCH  # a live record without the counter is not excused


@pytest.mark.parametrize("key", ["descriptor_checks", "descriptor_unchecked"])
def test_a_live_audit_record_without_the_descriptor_checks_counters_cannot_vouch(key):
    """Drop the descriptor check's counters from today's plugin: an audit case must not pass as a record from before
    the check; only the replays' upgrader may mark a record as that old."""
    c = case("audit")
    assert only(c, identity(counters={key: None})).startswith(f"the counters record lacks {key!r} (a live record")
    res = CaseResult(c.case_id, CLEAN, "tokens equal", backend_identity=identity(counters={key: None}))
    assert gate_judge.vouch(c, res).verdict == CANNOT_VOUCH
    old = {"descriptor_checks": None, "descriptor_unchecked": None, RECORDED_BEFORE: [channel.DESCRIPTOR_CHECK]}
    assert coverage.not_fired(c, identity(counters=old)) == []


def test_vouch_leaves_a_reference_as_it_is():
    ref = GateCase(BUILD, GateMode.parse("plain"), reference=True, inject=STALE_CAPTURE)  # see the docstring
    for verdict in (CLEAN, CRASH):
        res = CaseResult(ref.case_id, verdict, "", backend_identity=None)
        assert gate_judge.vouch(ref, res) is res


# -- the platform check --


@pytest.mark.parametrize("verdict", [CLEAN, "wrong-output", "crash"])
def test_a_gpu_that_computes_matrix_products_wrong_makes_any_case_an_error(verdict):
    """Recorded under MPS at 24 SMs (results/h200-mps-gemm-probe): max error 5.9 where bf16 gives 0.01."""
    c = case("plain")
    bad = {"gpu": "NVIDIA H200", "sms": 24, "gemm_check": {"max_error": 5.869, "tolerance": 0.1, "ok": False,
                                                             "worst": "19x1024x4096"}}  # fmt: skip
    lines = [
        'REPRO_PLUGIN {"installed": "probe"}',
        'REPRO_PLUGIN {"installed": "weights"}',
        "REPRO_DEVICE " + json.dumps(bad),
        'REPRO_RESULT {"tokens": [[1]], "summary": "1 request"}',
    ]
    got = gate_steps.annotate(CaseResult(c.case_id, verdict, "ran", evidence="seen"), c, "\n".join(lines), None)
    assert got.verdict == ERROR and "matrix products wrong" in got.reason and "5.869" in got.reason
    good = {**bad, "sms": 132, "gemm_check": {**bad["gemm_check"], "ok": True, "max_error": 0.008}}
    lines[2] = "REPRO_DEVICE " + json.dumps(good)
    assert gate_steps.annotate(CaseResult(c.case_id, CLEAN, "ran"), c, "\n".join(lines), None).verdict == CLEAN
    # the failure is a typed flag on the new record, what every later decision reads (gate_judge.platform_failed)
    assert PLATFORM_FAILED in got.flags and gate_judge.platform_failed(got)


def test_a_failed_platform_check_is_read_from_its_flag_never_from_a_history_step():
    """platform_failed decides by the typed flag alone: a record whose history merely names the step is not one (an
    older record gets the flag from the one upgrader of recorded results, upgrade_result, the only reader of the
    step's name)."""
    c = case("mps:24")
    named = CaseResult(c.case_id, CLEAN, "ran").revised("platform check", "said so", verdict=ERROR)
    assert not gate_judge.platform_failed(named)
    upgraded = CaseResult(**upgrade_result({k: v for k, v in named.to_dict().items() if k != "flags"}))
    assert gate_judge.platform_failed(upgraded) and upgraded.flags == [PLATFORM_FAILED]


# The reference checks and the comparison each rule of reference_problems / apply_reference / annotate rests on; each
# test below is named in tests/mutation_check.py beside the mutation that deletes its rule.
GOOD_REF_OUT = {"tokens": [[1, 2, 3, 4]], "margins": [[5.0, 5.0, 5.0, 5.0]], "nonfinite": []}
GOOD_REF_ENGINE = {"cudagraph_mode": "NONE", "speculative_method": "eagle", "num_speculative_tokens": 3}
GOOD_REF_ACCEPTANCE = {"spec_decode_num_accepted_tokens": 90, "spec_decode_num_draft_tokens": 100}


def _ref(engine: dict | None = None, acceptance: dict | None = None) -> tuple[GateCase, CaseResult]:
    ref = reference_for(case("plain"))
    ident = {"engine": {**GOOD_REF_ENGINE, **(engine or {})}, "counters": {}, "acceptance": acceptance}
    return ref, CaseResult(ref.case_id, CLEAN, "ran", backend_identity=ident)


def test_a_reference_that_reports_a_sound_configuration_is_trusted():
    ref, res = _ref(acceptance=GOOD_REF_ACCEPTANCE)
    assert gate_judge.reference_problems(ref, res, GOOD_REF_OUT) == []
    assert gate_judge.validate_reference(ref, res, GOOD_REF_OUT).verdict == CLEAN


def test_a_reference_that_ran_with_cuda_graphs_is_not_trusted():
    ref, res = _ref({"cudagraph_mode": "FULL_AND_PIECEWISE"}, GOOD_REF_ACCEPTANCE)
    assert gate_judge.reference_problems(ref, res, GOOD_REF_OUT) == [
        "the reference ran with CUDA graphs (cudagraph mode FULL_AND_PIECEWISE)"
    ]
    assert gate_judge.validate_reference(ref, res, GOOD_REF_OUT).verdict == ERROR


def test_a_speculative_reference_whose_draft_is_rarely_accepted_is_not_trusted():
    ref, res = _ref(acceptance={"spec_decode_num_accepted_tokens": 0, "spec_decode_num_draft_tokens": 100})
    (why,) = gate_judge.reference_problems(ref, res, GOOD_REF_OUT)
    assert why.startswith("the reference's draft (no CUDA graphs): 0 of 100 draft tokens accepted (0%), below 50%")


def test_a_live_reference_record_without_its_configuration_is_an_error_not_trusted():
    """Drop 'nonfinite' from today's worker: a reference with CUDA graphs at 0% acceptance must not slip through as a
    record from before the validation; only the replays' upgrader may mark a record as that old."""
    ref, res = _ref(
        {"cudagraph_mode": "FULL"}, {"spec_decode_num_accepted_tokens": 0, "spec_decode_num_draft_tokens": 9}
    )
    live = {k: v for k, v in GOOD_REF_OUT.items() if k != "nonfinite"}
    got = gate_judge.validate_reference(ref, res, live)
    assert got.verdict == ERROR and "lacks 'nonfinite'" in got.reason
    old = {**live, RECORDED_BEFORE: [channel.CONFIGURATION]}  # what the upgrader writes
    assert gate_judge.reference_problems(ref, res, old) == []  # its tokens are all an old record can show
    assert gate_judge.validate_reference(ref, res, old).verdict == CLEAN


DRAFTED = {"spec_decode_num_draft_tokens": 3, "spec_decode_num_accepted_tokens": 3}


def test_the_replays_upgrader_marks_only_result_records_without_their_configuration():
    from repro.contract.tags import COUNTERS_TAG, ENGINE_TAG, RESULT_TAG
    from repro.report.records import upgrade_channel as upgrade_records

    def rec(tag, data):
        return json.dumps({"schema": 1, "tag": tag, "pid": 1, "data": data})

    text = "\n".join(
        [
            rec(RESULT_TAG, {"tokens": [[1]]}),
            rec(RESULT_TAG, {"tokens": [[1]], "nonfinite": []}),
            rec(ENGINE_TAG, {"compilation_mode": None, "acceptance": DRAFTED}),
            rec(ENGINE_TAG, {"cudagraph_mode": "FULL"}),
            rec(COUNTERS_TAG, {"checks": 3}),
            rec(COUNTERS_TAG, FIRED["counters"]),
            rec(
                ENGINE_TAG, {"compilation_mode": None, "acceptance": DRAFTED, "counters": {"checks": 3, "backends": {}}}
            ),
        ]
    )
    got = [json.loads(line)["data"] for line in upgrade_records(text).splitlines()]
    assert got[0][RECORDED_BEFORE] == [channel.CONFIGURATION]
    assert RECORDED_BEFORE not in got[1] and RECORDED_BEFORE not in got[2]
    assert got[3][RECORDED_BEFORE] == [channel.COMPILATION, channel.ACCEPTANCE]  # nor the draft's acceptance
    # counters (the COUNTERS record, an ENGINE record's own) marked with each key they predate, today's not at all
    assert got[4][RECORDED_BEFORE] == [channel.DESCRIPTOR_CHECK, channel.SPEC_LAYOUT, channel.BACKENDS]
    assert got[5] == FIRED["counters"]
    assert RECORDED_BEFORE not in got[6] and got[6]["counters"][RECORDED_BEFORE] == [
        channel.DESCRIPTOR_CHECK,
        channel.SPEC_LAYOUT,
    ]
    # a log's `TAG {json}` lines from before the channel, the same way; other lines as they were
    old = upgrade_records('loading\nREPRO_RESULT {"tokens": [[1]]}\n').splitlines()
    assert old[0] == "loading" and json.loads(old[1].split(" ", 1)[1])[RECORDED_BEFORE] == ["configuration"]


def test_a_live_engine_record_without_its_compilation_mode_cannot_vouch_for_compile_none():
    c = replace(case(), compile="none")
    live = identity(engine={"compilation_mode": None})  # the key dropped
    assert only(c, live) == "--compile none: the engine record reports no compilation mode (a live record lacks it)"
    old = identity(engine={"compilation_mode": None, RECORDED_BEFORE: [channel.COMPILATION]})
    assert coverage.not_fired(c, old) == []  # a record the upgrader marked as from before the key existed


def _case_out(sms: int | None) -> dict:
    return {"tokens": [[1, 2, 3, 4]], "device": {"sms": sms}}


def test_a_reference_on_another_sm_count_cannot_judge_a_case():
    c = case("plain")
    ref, ref_res = _ref(acceptance=GOOD_REF_ACCEPTANCE)
    res = CaseResult(c.case_id, CLEAN, "ran", backend_identity=identity())
    got = gate_judge.apply_reference(res, _case_out(132), ref_res, {**GOOD_REF_OUT, "device": {"sms": 66}})
    assert got.verdict == ERROR and got.reason == (
        "the reference ran on 66 SMs, this case on 132: not the same SM configuration"
    )
    same = gate_judge.apply_reference(res, _case_out(132), ref_res, {**GOOD_REF_OUT, "device": {"sms": 132}})
    assert same.verdict != ERROR


def test_an_mps_case_that_got_other_sms_than_it_asked_is_an_error():
    c = case("mps:16")
    lines = [
        'REPRO_PLUGIN {"installed": "probe"}',
        'REPRO_PLUGIN {"installed": "weights"}',
        'REPRO_DEVICE {"gpu": "NVIDIA H200", "sms": 132}',
        'REPRO_RESULT {"tokens": [[1]], "summary": "1 request"}',
    ]
    got = gate_steps.annotate(CaseResult(c.case_id, CLEAN, "ran"), c, "\n".join(lines), None)
    assert got.verdict == ERROR and got.reason == "MPS gave this process 132 SMs, the case asked for 16"
    assert got.history[-1]["step"] == "MPS SM count"
    lines[2] = 'REPRO_DEVICE {"gpu": "NVIDIA H200", "sms": 16}'
    assert gate_steps.annotate(CaseResult(c.case_id, CLEAN, "ran"), c, "\n".join(lines), None).verdict == CLEAN


def test_near_ties_between_case_and_reference_are_counted_and_stop_the_request():
    tie = gate_judge.TIE_MARGIN / 2
    chk = gate_judge.compare_tokens([[1, 9, 3], [4, 5, 6]], [[1, 2, 3], [4, 5, 6]], [[5.0, tie, 5.0], [5.0] * 3])
    assert (chk.ties, chk.compared, chk.total, chk.wrong) == (1, 4, 6, [])
    assert "1 request(s) stopped at a near tie" in chk.describe()
    decided = gate_judge.compare_tokens([[1, 9, 3]], [[1, 2, 3]], [[5.0, gate_judge.TIE_MARGIN, 5.0]])
    assert (decided.ties, len(decided.wrong)) == (0, 1)  # a margin at TIE_MARGIN is decided: wrong output
    # too many ties: the comparison covers too little to vouch
    ref, ref_res = _ref(acceptance=GOOD_REF_ACCEPTANCE)
    c = case("plain")
    res = CaseResult(c.case_id, CLEAN, "ran", backend_identity=identity())
    out = {"tokens": [[1, 9, 9, 9]], "device": {"sms": 132}}
    ref_out = {"tokens": [[1, 2, 3, 4]], "margins": [[5.0, tie, 5.0, 5.0]], "device": {"sms": 132}}
    got = gate_judge.apply_reference(res, out, ref_res, ref_out)
    assert got.verdict == ERROR and "covered 1 of 4 tokens: too many near ties" in got.reason


def test_a_reference_without_an_engine_record_is_not_trusted():
    ref, res = _ref()
    res = replace(res, backend_identity={"counters": {}})
    assert gate_judge.reference_problems(ref, res, GOOD_REF_OUT) == [
        "the reference reported no engine configuration (no REPRO_ENGINE record)"
    ]


def _stale_audit_output(c: GateCase, engine: dict) -> str:
    """A case process's channel records: every feature it needs installed, its engine record (counters and acceptance
    inside), one stale view the auditor caught, its RESULT record on 132 SMs."""
    stale = {"descriptor": "t32r8", "buffer": "seq_lens", "field": "seq_lens", "index": 0, "now": 9, "built": 7}
    lines = [f"REPRO_PLUGIN {json.dumps({'installed': f})}" for f in sorted(coverage.features_needed(c))]
    lines += [
        "REPRO_ENGINE " + json.dumps(engine),
        "REPRO_AUDIT " + json.dumps({"stale": stale}),
        "REPRO_AUDIT " + json.dumps({"checks": 12, "descriptor_checks": 4}),
        "REPRO_RESULT " + json.dumps(_case_out(132)),
    ]
    return "\n".join(lines)


def _result_line() -> str:
    """A case process's RESULT record: it decoded (past the engine's start, its plugin loaded)."""
    return 'REPRO_RESULT {"tokens": [[1]], "summary": "1 request"}'


def test_a_cases_history_shows_the_declared_steps_in_their_order():
    """A case through every phase (steps.STEPS): annotated (the auditor's stale views), its reference validated, then
    compared (tokens, the draft's acceptance) and vouched for (the V2 runner did not run): its history names those
    steps, in STEPS's order."""
    c = case("audit")
    engine = {
        **FIRED["engine"],
        "model_runner_v2": False,
        "counters": FIRED["counters"],
        "acceptance": {"spec_decode_num_accepted_tokens": 85, "spec_decode_num_draft_tokens": 100},
    }
    res = gate_steps.annotate(CaseResult(c.case_id, CLEAN, "ran"), c, _stale_audit_output(c, engine), None)
    ref, ref_res = _ref(acceptance=GOOD_REF_ACCEPTANCE)
    ref_out = {**GOOD_REF_OUT, "device": {"sms": 132}}
    ref_res = gate_steps.validate(ref, ref_res, ref_out)
    got = gate_steps.finish(c, res, _case_out(132), ref_res, ref_out)
    assert got.verdict == CANNOT_VOUCH and "not the V2 model runner" in got.reason
    steps = [h["step"] for h in got.history]
    assert steps == ["audit", "reference comparison", "draft acceptance", "coverage"]
    assert [h["step"] for h in ref_res.history] == ["reference validation"]
    declared = [s.name for s in gate_steps.STEPS]
    assert [declared.index(s) for s in steps] == sorted(declared.index(s) for s in steps)
    # the phases in their order too: what its process left, then its reference's record, then the reference known
    phases = [s.when for s in gate_steps.STEPS]
    assert phases == sorted(phases, key=[gate_steps.ENDED, gate_steps.READ, gate_steps.KNOWN].index)


def test_the_first_finding_of_a_process_decides_and_a_skip_is_judged_no_further():
    """An MPS case whose plugin reported an install error and that got other SMs than it asked: the first check in
    STEPS's order (plugin) decides, the later (MPS SM count) is not asked; a skip gets no step at all."""
    c = case("mps:16")
    found = {"error": "probe: no such class"}, {"gpu": "NVIDIA H200", "sms": 132}  # a hook's error; 132 SMs, not 16
    out = "\n".join(f"{tag} {json.dumps(r)}" for tag, r in zip(("REPRO_PLUGIN", "REPRO_DEVICE"), found))
    got = gate_steps.annotate(CaseResult(c.case_id, CLEAN, "ran"), c, out + "\n" + _result_line(), None)
    assert [h["step"] for h in got.history] == ["plugin"] and got.verdict == ERROR
    skip = CaseResult(c.case_id, "skip", "no GPU")
    assert gate_steps.annotate(skip, c, out, None).history == []
    assert gate_steps.finish(c, skip, None, *_ref()[1:], None) is skip


def test_a_draft_is_not_judged_once_the_tokens_were_wrong():
    c = case("plain")
    res = CaseResult(c.case_id, CLEAN, "ran", backend_identity=identity())  # its acceptance: none reported
    ref_out = {**GOOD_REF_OUT, "device": {"sms": 132}}
    out = {"tokens": [[1, 9, 3, 4]], "device": {"sms": 132}}
    got = gate_steps.finish(c, res, out, _ref(acceptance=GOOD_REF_ACCEPTANCE)[1], ref_out)
    assert got.verdict == WRONG and [h["step"] for h in got.history] == ["reference comparison"]
    right = gate_steps.finish(c, res, _case_out(132), _ref(acceptance=GOOD_REF_ACCEPTANCE)[1], ref_out)
    assert right.verdict == CANNOT_VOUCH and right.history[-1]["step"] == "draft acceptance"


def test_each_judging_step_makes_a_new_record_and_leaves_the_earlier_as_it_was():
    """docs/architecture.md: classify builds the first record; annotation, reference validation and comparison and
    coverage each make a new one through CaseResult.revised, its history saying why."""
    ref, ref_res = _ref({"cudagraph_mode": "FULL"}, GOOD_REF_ACCEPTANCE)
    before = copy.deepcopy(ref_res)
    got = gate_judge.validate_reference(ref, ref_res, GOOD_REF_OUT)
    assert got is not ref_res and ref_res == before and got.history[-1]["step"] == "reference validation"
    c = case("plain")
    res = CaseResult(c.case_id, CLEAN, "ran", backend_identity=identity())
    before = copy.deepcopy(res)
    out = {"tokens": [[1, 9, 3, 4]], "device": {"sms": 132}}
    got = gate_judge.apply_reference(
        res, out, _ref(acceptance=GOOD_REF_ACCEPTANCE)[1], {**GOOD_REF_OUT, "device": {"sms": 132}}
    )
    assert got.verdict == WRONG and res == before and got.history[-1]["step"] == "reference comparison"


@pytest.mark.parametrize(
    "out,why",
    [
        ({"tokens": []}, "the reference run decoded no tokens"),
        ({**GOOD_REF_OUT, "nonfinite": ["request 0 token 2"]}, "non-finite log-probabilities (NaN or inf logits) at 1"),
        ({**GOOD_REF_OUT, "margins": [[5.0, None, 5.0, 5.0]]}, "no finite top-2 margin at 1 position(s)"),
        ({**GOOD_REF_OUT, "tokens": [[7, 3, 3, 3]]}, "request 0 decodes 7 then repeats 3 (a degenerate reference)"),
    ],
    ids=["no-tokens", "nonfinite", "no-margin", "degenerate"],
)
def test_a_reference_whose_tokens_cannot_be_ground_truth_is_not_trusted(out, why):
    ref, res = _ref(acceptance=GOOD_REF_ACCEPTANCE)
    problems = gate_judge.reference_problems(ref, res, out)
    assert len(problems) == 1 and problems[0].startswith(why), problems
    assert gate_judge.validate_reference(ref, res, out).verdict == ERROR


def test_a_case_without_a_clean_reference_cannot_be_compared():
    c = case("plain")
    res = CaseResult(c.case_id, CLEAN, "ran", backend_identity=identity())
    ref, ref_res = _ref(acceptance=GOOD_REF_ACCEPTANCE)
    broken = replace(ref_res, verdict=ERROR, reason="reference not trusted: x")
    got = gate_judge.apply_reference(res, _case_out(132), broken, {**GOOD_REF_OUT, "device": {"sms": 132}})
    assert got.verdict == ERROR and got.reason.startswith("no reference to compare with")


def test_a_recorded_results_backend_identity_is_marked_by_the_same_upgrader_and_then_vouches_as_it_did():
    """A results.json result recorded before the descriptor check, the spec layout and the per-backend count (its
    backend_identity as annotate stored it) is marked by upgrade_result, and only then read as it was read then."""
    from repro.report.records import upgrade_result  # noqa: PLC0415  the one upgrader of recorded results

    c = case("audit")
    counters = {k: v for k, v in FIRED["counters"].items() if k not in ("descriptor_checks", "descriptor_unchecked")}
    counters = {k: v for k, v in counters.items() if k not in ("spec_layout_known", "backends")}
    counters["attention_forwards"] = 40
    recorded = {
        "backend_identity": {**FIRED, "counters": counters, "engine": dict(FIRED["engine"]), "acceptance": DRAFTED}
    }
    assert len(coverage.not_fired(c, recorded["backend_identity"])) >= 3  # as a live record: each key said missing
    got = upgrade_result(recorded)["backend_identity"]
    assert got["counters"][RECORDED_BEFORE] == [channel.DESCRIPTOR_CHECK, channel.SPEC_LAYOUT, channel.BACKENDS]
    assert got["engine"][RECORDED_BEFORE] == [channel.COMPILATION]
    undrafted = {**recorded["backend_identity"], "acceptance": None}  # a reference from before references drafted
    assert upgrade_result({"backend_identity": undrafted})["backend_identity"]["engine"][RECORDED_BEFORE] == [
        channel.COMPILATION,
        channel.ACCEPTANCE,
    ]
    assert coverage.not_fired(c, got) == []


@pytest.mark.parametrize(
    "first,later",
    [("MPS SM count", "platform check"), ("platform check", "hang before capture"), ("hang before capture", "audit")],
)
def test_of_two_findings_in_one_process_the_earlier_check_in_steps_decides(first, later):
    """Each pair of neighbouring checks of a process's record, both finding something: the earlier in STEPS decides
    and the later is not asked. The order is the rule, not a listing: a GPU that computes wrong at an SM count it was
    not given is an MPS error (gate.run's platform memo reads which step decided). A hang with stale views the
    auditor counted is no hang before the captures (the auditor checks at capture): the audit decides it
    (test_a_hang_after_the_auditors_count_is_judged_by_the_count); a hang before capture with no stale view stays an
    error whatever the audit step would say of it."""
    if (first, later) == ("hang before capture", "audit"):
        later = None  # the pair's finding of the audit is a clean audit here: the hang alone finds something
    c = case("mps:16")
    wrong_gemm = {"max_error": 7.5, "tolerance": 0.1, "ok": False, "worst": "19x1024x4096"}
    fires = {
        "MPS SM count": lambda d: d.update(sms=132),
        "platform check": lambda d: d.update(gemm_check=wrong_gemm),
    }
    device = {"gpu": "NVIDIA H200", "sms": 16, "gemm_check": {"ok": True}}
    for name in (first, later):
        if name in fires:
            fires[name](device)
    hung = "hang before capture" in (first, later)
    stale = 1 if "audit" in (first, later) else 0
    hung = hung or first == "hang before capture"
    plugin = [{"installed": f} for f in coverage.features_needed(c)]
    lines = [f"REPRO_PLUGIN {json.dumps(p)}" for p in plugin] + [f"REPRO_DEVICE {json.dumps(device)}", _result_line()]
    audit = {"stale": stale, "descriptor": 0, "checks": 9, "descriptor_checks": 9, "fields": {},
             "first": ["a stale view"] * stale, "first_descriptor": None}  # fmt: skip
    res = CaseResult(c.case_id, HANG if hung else CLEAN, "no exit within 300 s" if hung else "ran", evidence="hang")
    facts = gate_steps.Facts(c, channel.Channel.from_output("\n".join(lines)), audit)
    got = gate_steps.judged(gate_steps.ENDED, facts, res)
    assert [h["step"] for h in got.history] == [first] and got.verdict == ERROR
