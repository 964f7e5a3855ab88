"""A stale-audit result's descriptor (attention layer, spec-decode case) is the one its worker typed where it found the
first difference (FIRST_STALE in its RESULT record), never a piece of a difference's words split off by classify. A
recorded RESULT from before that key gets it from its first difference's words in the one upgrader of recorded
channel records (repro.report.records.upgrade_channel), and only there."""

from __future__ import annotations

import json

from repro.case.spec import CaseSpec, SmConfig
from repro.contract.channel import Channel
from repro.contract.tags import FIRST_STALE, RESULT_TAG
from repro.contract.verdicts import STALE_AUDIT
from repro.judge.classify import classify
from repro.report.records import upgrade_channel

SPEC = CaseSpec("vllm", "stale", "eager", sm=SmConfig("sm_margin", 16), timeout_s=90)


def _result(**data) -> str:
    base = {"passes": 4, "max_abs_err": 0.0, "tolerance": 0.01, "wrong": False, "stale_fields": {"seq_lens": 3}}
    return f"{RESULT_TAG} {json.dumps({**base, **data})}\n"


def test_a_stale_audit_names_the_descriptor_its_worker_typed_whatever_its_differences_say():
    # a difference worded without its descriptor first: splitting its words named "seq_lens[2]" as the descriptor
    out = _result(first_diffs=["seq_lens[2]: 7 != 9", "t8r2: query_start_loc[1]"], **{FIRST_STALE: "t32r8"})
    r = classify(SPEC, out, 0, False, None, 1.0)
    assert r.verdict == STALE_AUDIT and r.descriptor == "t32r8", (r.verdict, r.descriptor)


def test_a_difference_reworded_changes_no_descriptor():
    said = [classify(SPEC, _result(first_diffs=d, **{FIRST_STALE: "t16r4"}), 0, False, None, 1.0) for d in
            (["t16r4: seq_lens[0] 3 != 5"], ["in other words"], [])]  # fmt: skip
    assert {(r.verdict, r.descriptor) for r in said} == {(STALE_AUDIT, "t16r4")}


def test_a_recorded_result_from_before_the_key_gets_its_first_differences_descriptor_from_the_upgrader_only():
    old = _result(first_diffs=["t32r8: seq_lens[0] 3 != 5", "t48r12: seq_lens[1]"])
    upgraded = Channel.from_output(upgrade_channel(old)).last(RESULT_TAG)
    assert upgraded[FIRST_STALE] == "t32r8"
    assert classify(SPEC, upgrade_channel(old), 0, False, None, 1.0).descriptor == "t32r8"
    none = Channel.from_output(upgrade_channel(_result(first_diffs=[]))).last(RESULT_TAG)
    assert none[FIRST_STALE] is None
    typed = _result(first_diffs=["x: y"], **{FIRST_STALE: "t8r2"})  # a record with the key: as it was
    assert Channel.from_output(upgrade_channel(typed)).last(RESULT_TAG)[FIRST_STALE] == "t8r2"
    # a live record is never upgraded: classify reads what its worker typed, nothing from its words
    assert classify(SPEC, old, 0, False, None, 1.0).descriptor is None
