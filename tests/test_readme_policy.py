"""docs/policy.md's sentences on the gate are the policy module's: its generated tables appear verbatim, and the
rule's numbers and names are the module's."""

from __future__ import annotations

from pathlib import Path

from repro.judge import policy
from repro.judge.control import GatingMode
from repro.vllm_integration.gate.modes import ALL_MODES, GateMode

POLICY_PAGE = (Path(__file__).resolve().parent.parent / "docs" / "policy.md").read_text()


def test_policy_page_holds_the_generated_rule_tables():
    assert policy.markdown() in POLICY_PAGE, (
        "regenerate docs/policy.md's tables: python -c 'from repro.judge.policy import markdown; print(markdown())'"
    )


def test_policy_page_names_every_expectation_requirement_and_audit_mode():
    rule = POLICY_PAGE[POLICY_PAGE.index("# The gate's rule") :]
    for e in policy.EXPECTATIONS:
        assert f"`{e}`" in rule
    for r in policy.REQUIREMENTS:
        assert r in rule.split("--gate-require", 1)[1]
    engine = [m.name for m in map(GateMode.parse, ALL_MODES) if m.policy_mode.engine_audit]
    assert engine == ["audit"]  # the auditor's own mode; its SM configurations (audit+mps:N) are that mode too
    for m in engine:
        assert f"vLLM's `{m}` mode" in rule
    assert "never a mode's evidence" in rule and policy.counts_as_evidence("stale-audit", GatingMode("eager")) is False
    assert "kernel evidence of another kind" in rule and policy.problem("fault", "hang") is None
    assert "`cannot-vouch` meet none" in rule and policy.problem("audit", "cannot-vouch")
