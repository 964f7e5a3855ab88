"""The control policy, in one place for `matrix --gate`, `pytest --gate` and `repro gate`: what each control must show,
which evidence meets it, which modes gate, and what a gate run needs from its controls.

Expectations are stored in each result before its case runs (repro.judge.expectations computes them for
attention-layer cases, repro.vllm_integration.gate.case.expected for vLLM builds).

`MEETS` says which verdicts meet each expectation, `markdown()` what each means (docs/policy.md shows both).

What a gate run needs (`decide`):
1. Every applicable control ran and met its expectation (skip, error and cannot-vouch meet none); a positive
   control that showed kernel evidence of another kind (a hang where `fault` was expected) passes, listed as a
   disagreement with the CPU model.
2. A control that cannot exist on this runner (MIG on a GPU without MIG, a vLLM case with no build named) is not
   applicable: listed with its reason, not a failure, unless the run requires that feature (`REQUIREMENTS`).
3. Each gating mode (the group a control belongs to: eager, graph, memcheck, or a vLLM gate mode) needs evidence
   from its OWN positive controls (a mode that ran only negative controls fails): kernel evidence, or for the modes
   in `ENGINE_AUDIT_MODES` (alone or in an SM configuration: `audit+mps:16`) the engine's own metadata caught stale by
   the auditor. The attention-layer stale-audit is the harness's bookkeeping: it meets an
   `audit` control but never counts as a mode's evidence.
4. At least one positive control ran.
5. A known-bad build (`known-bad` controls, grouped by `Control.subject`) shows evidence in at least one of its modes;
   a mode's miss is listed (`GateDecision.misses`): whether the real defect faults outside the audit depends on
   memory leftovers (docs/policy.md). The mode still needs evidence from a positive control of its own (rule 3).
6. A self control outside the audit (`any-form` controls, grouped by `Control.subject`: build, method, backend, mode,
   repetition) shows kernel evidence in at least one of its injection forms; a silent form beside a caught one is
   listed (`GateDecision.form_misses`): whether a form faults depends on what the speculator's capture recomputes at
   replay (docs/policy.md: DFlash). In the audit mode every form is its own `audit` control (rule 1)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from repro.contract.verdicts import (
    CANNOT_VOUCH,
    CLEAN,
    ERROR,
    KERNEL_EVIDENCE,
    LAUNCH_FAIL,
    MEMORY_FAULTS,
    SKIP,
    STALE_AUDIT,
    StrValue,
    Verdict,
)

FAULT, DETECTED, AUDIT, KNOWN_BAD_BUILD = "fault", "detected", "audit", "known-bad"
ANY_FORM, EXPECT_CLEAN, RECORDED = "any-form", "clean", "recorded"  # the order of EXPECTATIONS: MEETS's
# kinds of positive control a vLLM gate mode relies on: a build known to be bad, or one with the defect re-created
KNOWN_BAD, SELF_CONTROL = "known-bad build", "self-control"
MEETS: dict[str, tuple[str, ...]] = {
    # A launch that fails after stale metadata is the kernels failing too: upstream FA3's combine launch check reports
    # "Error Internal" there on the H200 (results/h200-launch-failures), where other configurations crash.
    FAULT: (*MEMORY_FAULTS, LAUNCH_FAIL),
    DETECTED: KERNEL_EVIDENCE,
    AUDIT: (*KERNEL_EVIDENCE, STALE_AUDIT),
    KNOWN_BAD_BUILD: (*KERNEL_EVIDENCE, STALE_AUDIT),  # STALE_AUDIT counts only in ENGINE_AUDIT_MODES (rule 5)
    ANY_FORM: KERNEL_EVIDENCE,
    EXPECT_CLEAN: (CLEAN,),
    RECORDED: (CLEAN, *KERNEL_EVIDENCE, STALE_AUDIT),
}
EXPECTATIONS = tuple(MEETS)
NO_EVIDENCE = (SKIP, ERROR, CANNOT_VOUCH)  # a control with one of these showed nothing either way

# Controls allowed to pass on the audit alone, and why (each row is a place where the kernels may stay silent).
AUDIT_CONTROLS = {
    "model: clean possible": "stale v2-capture cases where the CPU model finds a padding under which the kernels read "
    "nothing out of bounds and compute the right output",
    "unmeasured": "stale cases in a configuration no GPU run has measured and the CPU model does not decide (a "
    "sliding window, green contexts with a poison, MIG): no claim the GPU did not back",
    "spec-decode unpoisoned": "results/h200-spec-nopoison: stale-audit 4 of 4, tokens equal",
    "vllm audit mode": "the auditor reads vLLM's own metadata objects at capture time (evidence from the engine)",
}
# Gate modes whose stale-audit comes from the engine's own metadata (vLLM's), not the harness's builder.
ENGINE_AUDIT_MODES = ("audit",)


def engine_audit(mode: str) -> bool:
    """A mode whose stale-audit is the engine's: one of ENGINE_AUDIT_MODES, alone or in an SM configuration
    (`audit+mps:16`, `audit+sm_margin:8`: the auditor with that restriction)."""
    return mode.split("+", 1)[0] in ENGINE_AUDIT_MODES


# Features a runner can be told it must cover; absent ones are then failures instead of "not applicable".
REQUIREMENTS = {
    "mig": "a MIG slice pinned to each worker (REPRO_PINNED_DEVICE=MIG-...)",
    "mps": "nvidia-cuda-mps-control and an MPS daemon the run can start",
    "vllm": "a vLLM build named (REPRO_VLLM, or vllm installed)",
    "sanitizer": "compute-sanitizer (the CUDA toolkit)",
}
GATE_ENV = "REPRO_GATE"  # REPRO_GATE=1 is pytest's --gate (repro.pytest_options, repro.report.pytest_gate)
REQUIRE_ENV = "REPRO_GATE_REQUIRE"  # what a gate run requires, as --gate-require


def satisfies(expect: str, verdict: str) -> bool | None:
    """Does a verdict meet a control's expectation? None when the case did not run (skip)."""
    if expect not in MEETS:
        raise ValueError(f"unknown expectation {expect!r}; one of {', '.join(EXPECTATIONS)}")
    if verdict == SKIP:
        return None
    return verdict in MEETS[expect]


def is_positive(expect: str) -> bool:
    return expect in (FAULT, DETECTED, AUDIT, KNOWN_BAD_BUILD, ANY_FORM)


def counts_as_evidence(verdict: str, mode: str) -> bool:
    """Does this verdict, from a positive control of `mode`, show that the mode sees the bug?"""
    return verdict in KERNEL_EVIDENCE or (verdict == STALE_AUDIT and engine_audit(mode))


def parse_requirements(text: str | None) -> frozenset[str]:
    """`mig,mps,vllm` -> the features a gate run must cover; ValueError names an unknown one."""
    names = {x.strip() for x in (text or "").split(",") if x.strip()}
    unknown = names - set(REQUIREMENTS)
    if unknown:
        raise ValueError(f"unknown gate requirement(s) {sorted(unknown)}; choose from {', '.join(REQUIREMENTS)}")
    return frozenset(names)


@dataclass(frozen=True)
class Control:
    """One case as a gate sees it."""

    case_id: str
    expected: str
    verdict: str
    mode: str  # the gating mode it belongs to (eager, graph, memcheck, or a vLLM gate mode)
    reason: str = ""
    not_applicable: str | None = None  # why this configuration cannot exist on this runner
    needs: str | None = None  # the REQUIREMENTS feature whose absence made it not applicable
    kind: str | None = None  # a positive control's kind where it matters (vLLM gate: known-bad build, self-control)
    subject: str | None = None  # what rules 5 and 6 judge it over: its known-bad build, or its self control's forms

    @property
    def gating(self) -> bool:
        return self.expected != RECORDED

    def properties(self) -> list[tuple[str, object]]:
        """The control as a pytest test records it (record_property), for `pytest --gate` to read back whole
        (from_properties): one shape for every tier's controls."""
        out = [
            ("expected", self.expected),
            ("verdict", self.verdict),
            ("gate_mode", self.mode),
            ("reason", self.reason),
        ]
        for key in ("not_applicable", "needs", "kind", "subject"):
            if getattr(self, key) is not None:
                out.append((key, getattr(self, key)))
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
        return cls(
            case_id,
            str(props.get("expected") or EXPECT_CLEAN),
            verdict,
            str(props.get("gate_mode") or "eager"),
            reason,
            props.get("not_applicable"),
            props.get("needs"),
            kind=props.get("kind"),
            subject=props.get("subject"),
        )


def disagrees(expect: str, verdict: str) -> bool:
    """A positive control that showed kernel evidence of another kind than its expectation names."""
    return is_positive(expect) and verdict in KERNEL_EVIDENCE and not satisfies(expect, verdict)


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
            lines.append(f"  known-bad build silent in this mode, detected in another (rule 5): {x}")
        for x in self.form_misses:
            lines.append(f"  self-control form silent in this mode, another form caught (rule 6): {x}")
        by_reason: dict[str, list[str]] = {}
        for case, why in self.not_applicable:
            by_reason.setdefault(why, []).append(case)
        for why, cases in by_reason.items():
            lines.append(f"  not applicable ({len(cases)}): {why}")
        return lines


def problem(expect: str, verdict: str) -> str | None:
    """Why one control fails a gate, None when it passes. A positive control passes a gate with any kernel evidence:
    which kind (a hang where the CPU model expected a fault) is a disagreement with the model (`disagrees`), reported
    but not gating: a stale control that hung has shown the bug (results/h200-launch-failures-2: 1 of 128)."""
    if verdict in NO_EVIDENCE:
        return f"{verdict}: the gate has no evidence from this control"
    if expect == KNOWN_BAD_BUILD:
        return None  # a known-bad build that ran: one mode's miss is judged over all its modes (decide, rule 5)
    if expect == ANY_FORM:
        return None  # a self control's form that ran: judged over the forms of its mode (decide, rule 6)
    if satisfies(expect, verdict) or (is_positive(expect) and verdict in KERNEL_EVIDENCE):
        return None
    if expect == EXPECT_CLEAN:
        return f"negative control came back {verdict}"
    return f"positive control came back {verdict}, expected {expect} ({', '.join(MEETS[expect])})"


def decide(controls: Iterable[Control], required: frozenset[str] = frozenset()) -> GateDecision:
    """The gate's decision over every control of a run (rules 1-6 of this module's docstring)."""
    d = GateDecision()
    bad_builds: dict[str, list[Control]] = {}  # rule 5: subject -> its positive controls that ran
    forms: dict[str, list[Control]] = {}  # rule 6: subject -> the injection forms of one self control that ran
    for c in controls:
        if c.not_applicable is not None:
            if c.needs and c.needs in required:
                d.failures.append(
                    Failure(f"{c.case_id}: required ({c.needs}) but {c.not_applicable}", NOT_COVERED, c.case_id)
                )
            else:
                d.not_applicable.append((c.case_id, c.not_applicable))
            continue
        d.ran += 1
        if c.gating and (why := problem(c.expected, c.verdict)):
            d.failures.append(Failure(f"{c.case_id}: {why}: {c.reason[:160]}", CONTROL_FAILED, c.case_id))
        elif c.gating and disagrees(c.expected, c.verdict):
            d.disagreements.append(f"{c.case_id}: {c.verdict}, the expectation was {c.expected}")
        if c.gating:
            pos, ev = d.evidence.get(c.mode, (0, 0))
            if c.expected == ANY_FORM and c.verdict not in NO_EVIDENCE:  # without a subject: a form alone
                forms.setdefault(c.subject or c.case_id, []).append(c)
            elif c.subject is not None and is_positive(c.expected) and c.verdict not in NO_EVIDENCE:
                bad_builds.setdefault(c.subject, []).append(c)
            if is_positive(c.expected):
                shown = counts_as_evidence(c.verdict, c.mode)
                pos, ev = pos + 1, ev + shown
                if c.kind is not None:
                    kp, ke = d.evidence_by_kind.setdefault(c.mode, {}).get(c.kind, (0, 0))
                    d.evidence_by_kind[c.mode][c.kind] = (kp + 1, ke + shown)
            d.evidence[c.mode] = (pos, ev)
    for subject, cs in bad_builds.items():
        shown = [c for c in cs if counts_as_evidence(c.verdict, c.mode)]
        silent = [c for c in cs if c.expected == KNOWN_BAD_BUILD and not counts_as_evidence(c.verdict, c.mode)]
        if silent and not shown:
            d.failures.append(
                Failure(
                    f"{silent[0].case_id}: known-bad build {subject} showed no evidence in any of its modes "
                    f"({', '.join(f'{c.mode}: {c.verdict}' for c in cs)}): {silent[0].reason[:160]}",
                    CONTROL_FAILED,
                    silent[0].case_id,
                )
            )
        elif silent:
            d.misses += [
                f"{c.case_id}: {c.verdict} (detected in {', '.join(sorted({x.mode for x in shown}))})" for c in silent
            ]
    _judge_forms(d, forms)
    for mode, (pos, ev) in sorted(d.evidence.items()):
        if not pos:  # only negative controls in this mode: nothing shows that the mode could see the bug
            d.failures.append(
                Failure(
                    f"GATE FAILED: mode {mode}: no positive control ran in it, so a clean answer there shows nothing",
                    MODE_WITHOUT_POSITIVE,
                )
            )
        elif not ev:
            what = "kernel evidence" + (" or the engine's audit" if engine_audit(mode) else "")
            d.failures.append(
                Failure(
                    f"GATE FAILED: mode {mode}: none of its {pos} positive control(s) produced {what}: "
                    "this environment cannot show that this mode sees the bug",
                    MODE_WITHOUT_EVIDENCE,
                )
            )
    if not any(pos for pos, _ in d.evidence.values()):
        d.failures.append(
            Failure(
                "GATE FAILED: no positive control ran: this environment cannot show that it sees the bug", NO_POSITIVE
            )
        )
    return d


def _judge_forms(d: GateDecision, forms: dict[str, list[Control]]) -> None:
    """Rule 6: a self control none of whose forms showed evidence in its mode fails; a silent one beside another is listed."""
    for subject, cs in forms.items():
        shown = [c.case_id for c in cs if counts_as_evidence(c.verdict, c.mode)]
        silent = [c for c in cs if not counts_as_evidence(c.verdict, c.mode)]
        if not shown:
            d.failures.append(
                Failure(
                    f"{silent[0].case_id}: positive control came back {silent[0].verdict}: self control {subject} "
                    f"showed no evidence in any of its injection forms "
                    f"({', '.join(f'{c.case_id}: {c.verdict}' for c in cs)}): {silent[0].reason[:160]}",
                    CONTROL_FAILED,
                    silent[0].case_id,
                )
            )
        else:
            d.form_misses += [f"{c.case_id}: {c.verdict} (caught by {', '.join(shown)})" for c in silent]


def markdown() -> str:
    """The rule as docs/policy.md shows it (a CPU test keeps the page's copy equal to this)."""
    why = {
        FAULT: "the kernels failed: a memory fault, or a launch that failed after stale metadata",
        DETECTED: "kernel evidence",
        AUDIT: "kernel evidence, or the capture-time audit's stale views",
        KNOWN_BAD_BUILD: "a known-bad vLLM build: evidence in at least one of its modes (a mode's miss is listed)",
        ANY_FORM: "a self control outside the audit: evidence from at least one of its injection forms in the mode "
        "(a silent form is listed)",
        EXPECT_CLEAN: "ran, output equals the reference, nothing stale",
        RECORDED: "anything that ran (memcheck on real vLLM: recorded, never gating)",
    }
    lines = ["| expectation | met by | meaning |", "|---|---|---|"]
    lines += [f"| `{e}` | {', '.join(f'`{v}`' for v in MEETS[e])} | {why[e]} |" for e in EXPECTATIONS]
    lines += ["", "| audit control | why the audit alone may meet it |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in AUDIT_CONTROLS.items()]
    lines += ["", "| requirement (`--gate-require`) | what the runner must have |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in REQUIREMENTS.items()]
    return "\n".join(lines)
