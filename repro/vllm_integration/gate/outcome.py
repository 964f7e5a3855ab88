"""What a gate run holds and what it decides: GateRun (every case, reference, rerun and further attempt with its
result; the run's walls and launches) and its outcome through the policy (repro.judge.policy: decide over each case as
a Control, control_of), decided once (GateRun.judge) and read by every report and the exit code. The run that fills
it: repro.vllm_integration.gate.run."""

from __future__ import annotations

from dataclasses import dataclass, field

from repro.case.spec import CaseResult
from repro.contract.verdicts import CANNOT_VOUCH as NOT_VOUCHED
from repro.contract.verdicts import FAULTS
from repro.judge import policy
from repro.judge.control import Control
from repro.judge.decision import NEEDS_A_CONTROL, GateDecision, GateJudgment, GateOutcome
from repro.vllm_integration.gate.case import GateCase, expected, subject_of
from repro.vllm_integration.gate.judge import passes
from repro.vllm_integration.gate.process import Attempt

NO_CONTROL = "no positive control ran in a gating mode"


@dataclass
class GateRun:
    cases: list[tuple[GateCase, CaseResult]] = field(default_factory=list)
    references: list[tuple[GateCase, CaseResult]] = field(default_factory=list)
    attributions: list[tuple[GateCase, CaseResult]] = field(default_factory=list)  # launch-blocking reruns
    attempts: list[tuple[GateCase, CaseResult]] = field(default_factory=list)  # a self control's further attempts
    attempted: dict[str, list[Attempt]] = field(default_factory=dict)  # case id -> each attempt, the first included
    wall_s: float = 0.0
    started_at: float = 0.0  # when run_gate began (epoch s)
    setup_s: float | None = None  # a command's start-up before run_gate (CLI, builds, its GPU check); None: no command
    command_s: float | None = None  # the command's wall from its start to its report (None: no command)
    build_wall_s: dict[str, float] = field(default_factory=dict)
    launches: dict[str, dict] = field(default_factory=dict)  # per build: how its case processes started (Launcher)
    mps_reruns: list[dict] = field(default_factory=list)  # MPS cases run again (repro.run.mps_cases): which, after what
    source_checks: dict[str, str] = field(default_factory=dict)  # build prefix -> its source check (report), once
    judgment: GateJudgment | None = None  # the answer, decided once (judge) and read by every report

    def controls(self) -> list[Control]:
        """Every case as the policy sees it (control_of)."""
        return [control_of(c, r) for c, r in self.cases]

    def decision(self, need_control: bool = True) -> GateDecision:
        """repro.judge.policy.decide over every case; without need_control (a bisect step answering for its build alone)
        the missing positive control is not a failure."""
        d = policy.decide(self.controls())
        if not need_control:
            d.failures = [f for f in d.failures if f.kind not in NEEDS_A_CONTROL]
        return d

    def affected(self) -> list[tuple[GateCase, CaseResult]]:
        """Builds under test whose case did not come back clean (the bug, or no answer); a method the build does not
        have is neither (not applicable)."""
        return [(c, r) for c, r in self.cases if not c.is_control and not passes(c, r) and r.not_applicable is None]

    def unanswered(self) -> dict[str, str]:
        """Builds under test none of whose cases could run (every method asked for is one the build lacks) -> each
        distinct reason: no answer for them either way, never a PASS nor a blind harness."""
        under: dict[str, list[CaseResult]] = {}
        for c, r in self.cases:
            if not c.is_control:
                under.setdefault(c.build.label, []).append(r)
        return {
            label: "; ".join(dict.fromkeys(r.not_applicable or "" for r in rs))
            for label, rs in under.items()
            if all(r.not_applicable is not None for r in rs)
        }

    def not_vouched(self) -> list[tuple[GateCase, CaseResult]]:
        """Cases (under test or control) whose checked feature did not fire."""
        return [(c, r) for c, r in self.cases if r.verdict == NOT_VOUCHED]

    def blind(self, need_control: bool = True) -> list[str]:
        """Why the controls cannot vouch for the run: the policy's failures that are not about a build under test."""
        under = {c.case_id for c, _ in self.cases if not c.is_control}
        out = []
        for f in self.decision(need_control).failures:
            if f.case_id in under:
                continue
            if f.kind in NEEDS_A_CONTROL:
                f = (
                    f"{NO_CONTROL} (a build's self control: --self-control under-test; a known-bad build: "
                    f"--control 0.25.1=<prefix>): {f}"
                )
            out.append(f)
        return out

    def outcome(self, need_control: bool = True) -> GateOutcome:
        """AFFECTED (a build under test showed the bug), CANNOT VOUCH (a case's checked feature did not fire, or a
        build under test errored or skipped), HARNESS BLIND (repro.judge.policy.decide failed on the controls: a control
        missed, or a gating mode has no evidence from its own control, or none ran while one is needed; before it, a
        build under test none of whose cases applies: CANNOT VOUCH) or PASS;
        repro.exit_codes.gate gives its exit code."""
        affected = self.affected()
        if any(r.verdict in FAULTS for _, r in affected):
            return GateOutcome.AFFECTED
        if affected or self.not_vouched() or self.unanswered():
            return GateOutcome.CANNOT_VOUCH
        return GateOutcome.BLIND if self.blind(need_control) else GateOutcome.PASS

    def judge(self, need_control: bool = True) -> GateJudgment:
        """Decide the run's answer once, for the question asked (need_control), and store it: reports read it."""
        d = self.decision(need_control)
        self.judgment = GateJudgment(need_control, self.outcome(need_control), tuple(self.blind(need_control)), d)
        return self.judgment

    def judged(self) -> GateJudgment:
        """The stored answer (judge); a run no command judged answers the gate's own question (a control needed)."""
        return self.judgment or self.judge()


def control_of(case: GateCase, res: CaseResult) -> Control:
    """A gate case as the policy sees it, in `repro gate` and in the pytest tier alike, typed whole: its mode as the
    policy counts it (GateMode.policy_mode), why it is not applicable (the result's typed field), the kind of
    control, and what policy rules 5 and 6 judge it over (subject_of: a tuple)."""
    expect = res.expected or expected(case)
    return Control(
        case.case_id,
        expect,
        res.verdict,
        case.mode.policy_mode,
        res.reason,
        res.not_applicable,
        kind=case.control_kind,
        subject=subject_of(case, expect),
        variant=(case.method, case.backend),
    )
