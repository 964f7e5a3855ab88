"""README's sentences on the gate are the policy module's: its generated tables appear verbatim, and the rule's
numbers and names are the module's."""

from __future__ import annotations

from pathlib import Path

from repro import policy

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def test_readme_holds_the_generated_rule_tables():
    assert policy.markdown() in README, "regenerate README's tables: python -c 'from repro.policy import markdown'"


def test_readme_names_every_expectation_requirement_and_audit_mode():
    rule = README[README.index("## The gate's rule") :]
    for e in policy.EXPECTATIONS:
        assert f"`{e}`" in rule
    for r in policy.REQUIREMENTS:
        assert r in rule.split("--gate-require", 1)[1]
    for m in policy.ENGINE_AUDIT_MODES:
        assert f"vLLM's `{m}` mode" in rule
    assert "never a mode's evidence" in rule and policy.counts_as_evidence("stale-audit", "eager") is False
    assert "kernel evidence of another kind" in rule and policy.problem("fault", "hang") is None
    assert "`cannot-vouch` meet none" in rule and policy.problem("audit", "cannot-vouch")
