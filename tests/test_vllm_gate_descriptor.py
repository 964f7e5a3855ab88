"""The descriptor check through the gate, on stand-in builds (tests/fake_vllm.py): a build whose draft capture builds
each descriptor's metadata for another descriptor of its capture list, consistently, decodes clean in plain and is
AFFECTED through the audit's stale-descriptor evidence alone; a healthy build's self control runs in both forms, each
its own case, each caught by the auditor in the audit mode; the healthy build itself is clean with the check counted."""

from __future__ import annotations

import importlib.metadata

import pytest

from repro.contract.verdicts import CLEAN, CRASH, STALE_AUDIT
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.releases.builds import UNDER_TEST, parse_builds
from tests.fake_vllm import write_fake_vllm

needs_entry_point = pytest.mark.skipif(
    not any(e.value.startswith("repro.") for e in importlib.metadata.entry_points(group="vllm.general_plugins")),
    reason="the repro plugin's entry point is not installed (pip install -e .)",
)


@needs_entry_point
def test_a_build_for_the_wrong_descriptor_is_affected_through_the_audit_and_both_self_control_forms_are_caught(
    tmp_path,
):
    good = write_fake_vllm(tmp_path / "good", "0.34.0", "good")
    wrong = write_fake_vllm(tmp_path / "wrong", "0.34.0", "stale-descriptor")
    builds = parse_builds(f"good={good},sd={wrong}", UNDER_TEST, "REPRO_VLLM")
    # forked case processes: the spawned launcher's records on every stand-in behaviour (test_vllm_gate_fork)
    run = run_gate(builds, parse_modes("audit,plain"), tmp_path / "logs", jobs=4, timeout_s=120, launcher="fork")
    v = {c.case_id.split("-vllm-")[1]: r for c, r in run.cases}
    clean = v["good-under-test-audit"]
    assert clean.verdict == CLEAN and "descriptor checks" in clean.evidence, clean.evidence
    counters = clean.backend_identity["counters"]
    assert set(counters["descriptor_checks"]) == {"target decode", "draft prefill", "draft decode"}
    assert not counters["descriptor_unchecked"] and not counters["descriptor_stale"]
    sd = v["sd-under-test-audit"]
    assert sd.verdict == STALE_AUDIT and "of them stale-descriptor" in sd.evidence, sd.evidence
    assert "built for another descriptor while capturing FULL t32r8 q4" in sd.reason  # the t4r1 build
    assert v["sd-under-test-plain"].verdict == CLEAN  # its kernels stay in bounds: the audit alone sees it
    for form in ("self-control", "self-control-stale-descriptor"):
        audit = v[f"good-{form}-audit"]
        assert audit.verdict == CRASH and audit.stale_fields, (form, audit.reason)  # the auditor caught it too
        assert v[f"good-{form}-plain"].verdict == CRASH
    assert "stale-descriptor" in v["good-self-control-stale-descriptor-audit"].evidence
    assert {c.case_id.split("-vllm-")[1] for c, _ in run.affected()} == {"sd-under-test-audit"}
