"""What the control policy decides for a gate run (repro.judge.policy.decide makes it): GateDecision (the failures,
each a typed Failure of a kind, what each mode's positive controls showed, what was listed and not failed), and the
answer a run gives through it (GateOutcome, stored once with its decision in a GateJudgment: every report and the
exit code read that one record)."""

from __future__ import annotations

from dataclasses import dataclass, field

from repro.contract.verdicts import StrValue
from repro.judge.control import KNOWN_BAD

# Kinds of gate failure (Failure.kind): callers decide by kind, never by the message's words.
CONTROL_FAILED, NOT_COVERED, MODE_WITHOUT_POSITIVE, MODE_WITHOUT_EVIDENCE, NO_POSITIVE = (
    "control failed",
    "required feature absent",
    "mode without a positive control",
    "mode without evidence",
    "no positive control",
)
NEEDS_A_CONTROL = (MODE_WITHOUT_POSITIVE, NO_POSITIVE)  # failures that only say no positive control ran
GATE_WIDE = (MODE_WITHOUT_POSITIVE, MODE_WITHOUT_EVIDENCE, NO_POSITIVE)  # a mode's or the gate's, no one case's


class Failure(str):
    """One reason a gate fails: its text (what reports print and JSON keeps), its kind and, where one control failed,
    that control's case id."""

    kind: str
    case_id: str | None

    def __new__(cls, text: str, kind: str, case_id: str | None = None) -> Failure:
        obj = super().__new__(cls, text)
        obj.kind, obj.case_id = kind, case_id
        return obj


class GateOutcome(StrValue):
    """What `repro gate` answers for a run (repro.vllm_integration.gate.outcome.GateRun.outcome decides it from decide's
    failures, by their kind, and from the builds under test; repro.exit_codes gives its exit code): a str that
    equals, prints and serialises as its value ("HARNESS BLIND"), as reports and results.json have always shown it."""

    PASS = "PASS"
    AFFECTED = "AFFECTED"
    BLIND = "HARNESS BLIND"
    CANNOT_VOUCH = "CANNOT VOUCH"


@dataclass(frozen=True)
class GateJudgment:
    """A gate run's answer, decided once (GateRun.judge) for the question it was asked (need_control: False for
    `--no-control`, where the builds answer for themselves) and stored on the run: every report, paths.json and the
    exit code read this one record, never a decision of their own."""

    need_control: bool
    outcome: GateOutcome
    blind: tuple[str, ...]
    decision: GateDecision


@dataclass
class GateDecision:
    failures: list[Failure] = field(default_factory=list)
    disagreements: list[str] = field(default_factory=list)  # evidence of another kind than expected (not gating)
    not_applicable: list[tuple[str, str]] = field(default_factory=list)  # (case, reason)
    ran: int = 0
    evidence: dict[str, tuple[int, int]] = field(default_factory=dict)  # mode -> (positive controls, with evidence)
    # mode -> control kind -> (positive controls, with evidence): which kind of control each mode relied on
    evidence_by_kind: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    # listed, not failed: a known-bad build silent in one mode, caught in another (5); a form beside a caught one (6)
    misses: list[str] = field(default_factory=list)
    form_misses: list[str] = field(default_factory=list)
    silent_builds: list[str] = field(default_factory=list)  # known-bad builds silent in every mode and method (5)

    @property
    def passed(self) -> bool:
        return not self.failures

    def summary(self) -> list[str]:
        """Lines for a person: what ran, what each mode's controls showed, what was not applicable and why."""
        lines = [f"gate: {self.ran} control(s) ran; {len(self.not_applicable)} not applicable here"]
        for mode, (pos, ev) in sorted(self.evidence.items()):
            kinds = self.evidence_by_kind.get(mode) or {}
            if set(kinds) <= {KNOWN_BAD}:  # the one kind every gate had before self controls: nothing to tell apart
                kinds = {}
            how = "; ".join(f"{k}: {e} of {p}" for k, (p, e) in sorted(kinds.items()))
            lines.append(
                f"  mode {mode}: {ev} of {pos} positive control(s) showed evidence" + (f" ({how})" if how else "")
            )
        for x in self.disagreements:
            lines.append(f"  evidence of another kind than expected (not gating): {x}")
        for x in self.misses:
            lines.append(f"  known-bad build silent here, detected in another mode or variant (rule 5): {x}")
        for x in self.form_misses:
            lines.append(f"  self-control form silent in this mode, another form caught (rule 6): {x}")
        by_reason: dict[str, list[str]] = {}
        for case, why in self.not_applicable:
            by_reason.setdefault(why, []).append(case)
        for why, cases in by_reason.items():
            lines.append(f"  not applicable ({len(cases)}): {why}")
        return lines
