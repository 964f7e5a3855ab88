"""The answer of an audited run from its typed records (repro.vllm_integration.ci.judge), one rule per test: each
starts from a clean multi-process report (a front-end with no checks, an engine core with FULL captures audited and
descriptor checks) and changes the one thing its rule reads."""

from __future__ import annotations

import copy

from repro.judge.decision import GateOutcome
from repro.vllm_integration.ci.judge import CommandStatus, Expect, judge

MGR = "SpeculatorCudaGraphManager.prefill_cudagraph_manager of StandaloneARSpeculator"
CORE = {"pid": 2, "process": "EngineCore", "checks": 560, "descriptor_checks": 148, "stale": 0, "counters": {
    "installed": ["audit", "probe"], "full_captures_by_manager": {MGR: 30}, "audited_by_manager": {MGR: 30},
    "descriptor_unchecked": {}, "spec_layout": "target_dependent_ar", "spec_layout_known": True,
    "speculative_methods": {"draft_model": 60}}}  # fmt: skip
FRONT = {"pid": 1, "process": "MainProcess", "checks": 0, "descriptor_checks": 0, "stale": 0,
         "counters": {"installed": ["audit", "probe"]}}  # fmt: skip
CLEAN = {"processes": [FRONT, CORE], "mismatches": []}


def _doc(**core) -> dict:
    d = copy.deepcopy(CLEAN)
    for k, v in core.items():
        (d["processes"][1]["counters"] if k in CORE["counters"] else d["processes"][1])[k] = v
    return d


def test_a_clean_multi_process_run_passes_with_its_captures_per_manager():
    j = judge(CLEAN, [{"pid": 1}, {"pid": 2}], Expect(method="draft_model"))
    assert j.outcome == GateOutcome.PASS and j.reasons == [] and j.audited_by_manager == {MGR: 30}
    assert j.descriptor_checks == 148 and j.methods == {"pid 2 (EngineCore)": "draft_model"}


def test_stale_descriptor_fields_are_affected_each_descriptor_and_field_named_once():
    m = {"descriptor": "FULL t138r23 q6", "buffer": "num_reqs", "field": "num_reqs (object field)", "index": 0,
         "built": 23, "now": 24, "kind": "stale-descriptor"}  # fmt: skip
    d = _doc()
    d["mismatches"] = [m, m]
    j = judge(d, [], Expect(), CommandStatus(("python", "x.py"), 0))
    assert j.outcome == GateOutcome.AFFECTED
    assert j.reasons == ["FULL t138r23 q6: num_reqs (object field) (stale-descriptor): 24 where its build gives 23"]


def test_each_thing_that_did_not_fire_is_cannot_vouch_with_its_reason():
    cases = {
        "no vLLM process reported an audit": None,
        "no process installed the freshness auditor": {"processes": [{**FRONT, "counters": {"installed": ["probe"]}}]},
        "the freshness auditor made 0 checks": _doc(checks=0),
        "no FULL CUDA graph capture was audited": _doc(audited_by_manager={}),
        "the descriptor check never ran": _doc(descriptor_checks=0),
        "could not build its reference at 2 FULL pass(es)": _doc(descriptor_unchecked={"draft prefill: why": 2}),
        "a speculative-decoding layout the auditor does not know": _doc(spec_layout_known=False),
        "1 FULL capture(s) by Other.m of X, none audited": _doc(full_captures_by_manager={MGR: 30, "Other.m of X": 1}),
    }
    for words, doc in cases.items():
        j = judge(doc, [], Expect())
        assert j.outcome == GateOutcome.CANNOT_VOUCH and any(words in r for r in j.reasons), (words, j.reasons)


def test_a_process_that_never_reported_the_timeout_and_another_method_cannot_vouch():
    j = judge(CLEAN, [{"pid": 3, "process": "EngineCore_DP1"}], Expect())
    assert j.reasons == ["pid 3 (EngineCore_DP1) installed the auditor and never reported (killed, or died before "
                         "its exit report)"]  # fmt: skip
    j = judge(CLEAN, [], Expect(), CommandStatus(("x",), None, timed_out=True, seconds=60))
    assert j.outcome == GateOutcome.CANNOT_VOUCH and "stopped at its timeout after 60 s" in j.reasons[0]
    j = judge(CLEAN, [], Expect(method="eagle"))
    assert j.reasons == [
        "pid 2 (EngineCore): speculative method asked for: eagle; the model runner the plugin saw capturing ran: "
        "draft_model"
    ]
