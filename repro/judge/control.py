"""One case as the control policy judges it (repro.judge.policy.decide): a Control, typed whole, built once per case
(the attention layer's in repro.report.results and cases/controls.py, a vLLM gate case's in
repro.vllm_integration.gate.outcome.control_of) and recorded by a pytest test as plain properties that
`pytest --gate` reads back into the same Control (properties, from_properties).

What a control carries is data the policy decides by, never words it reads again: its expectation (one of the names
below, the order of policy.MEETS), its verdict, its mode as an object (GatingMode: the group its evidence counts in,
and whether that group's stale-audit is the engine's own), why it is not applicable (None: it ran or was meant to),
its kind of positive control and its subject (a tuple: what policy rules 5 and 6 judge it over)."""

from __future__ import annotations

from dataclasses import dataclass

from repro.contract.verdicts import ERROR, SKIP, Verdict

# A control's expectation: what its verdict must be for the gate (what meets each: repro.judge.policy.MEETS).
FAULT, DETECTED, AUDIT, KNOWN_BAD_BUILD = "fault", "detected", "audit", "known-bad"
ANY_FORM, EXPECT_CLEAN, RECORDED = "any-form", "clean", "recorded"
# kinds of positive control a vLLM gate mode relies on: a build known to be bad, or one with the defect re-created
KNOWN_BAD, SELF_CONTROL = "known-bad build", "self-control"


@dataclass(frozen=True)
class GatingMode:
    """The gating mode a control belongs to: the group whose evidence is counted together (eager, graph, memcheck, or
    a vLLM gate mode by its name), and whether a stale-audit in it is the engine's own metadata caught by the auditor
    inside vLLM (a gate mode with the auditor, alone or in an SM configuration: `audit+mps:16`), which counts as the
    mode's evidence, rather than the attention layer's builder (the harness's bookkeeping, which never does)."""

    name: str
    engine_audit: bool = False

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Control:
    """One case as a gate sees it."""

    case_id: str
    expected: str
    verdict: str
    mode: GatingMode
    reason: str = ""
    not_applicable: str | None = None  # why this configuration cannot exist on this runner
    needs: str | None = None  # the REQUIREMENTS feature whose absence made it not applicable
    kind: str | None = None  # a positive control's kind where it matters (vLLM gate: known-bad build, self-control)
    subject: tuple[str, ...] | None = None  # what rules 5 and 6 judge it over: its known-bad build, or its self control
    variant: tuple[str, ...] | None = None  # the path a vLLM case runs (method, backend): rule 5's evidence per path

    @property
    def gating(self) -> bool:
        return self.expected != RECORDED

    def properties(self) -> list[tuple[str, object]]:
        """The control as a pytest test records it (record_property), for `pytest --gate` to read back whole
        (from_properties): one shape for every tier's controls."""
        out = [
            ("expected", self.expected),
            ("verdict", self.verdict),
            ("gate_mode", self.mode.name),
            ("engine_audit", self.mode.engine_audit),
            ("reason", self.reason),
        ]
        for key in ("not_applicable", "needs", "kind"):
            if getattr(self, key) is not None:
                out.append((key, getattr(self, key)))
        for key in ("subject", "variant"):
            if getattr(self, key) is not None:
                out.append((key, list(getattr(self, key))))
        return out

    @classmethod
    def from_properties(cls, case_id: str, props: dict) -> Control:
        """A control from what its test recorded (properties, or a test that recorded only some before it
        skipped: no verdict is a skip, no expectation a negative control)."""
        verdict, reason = props.get("verdict") or SKIP, str(props.get("reason") or "")
        try:  # recorded plain (a str, to cross xdist): typed again here, the one place
            verdict = Verdict(verdict)
        except ValueError:
            verdict, reason = ERROR, f"the case recorded an unknown verdict {verdict!r}: {reason}"
        subject, variant = props.get("subject"), props.get("variant")
        return cls(
            case_id,
            str(props.get("expected") or EXPECT_CLEAN),
            verdict,
            GatingMode(str(props.get("gate_mode") or "eager"), bool(props.get("engine_audit"))),
            reason,
            props.get("not_applicable"),
            props.get("needs"),
            kind=props.get("kind"),
            subject=tuple(str(x) for x in subject) if subject is not None else None,
            variant=tuple(str(x) for x in variant) if variant is not None else None,
        )
