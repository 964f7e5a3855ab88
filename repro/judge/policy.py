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
   whose audit is the engine's (GatingMode.engine_audit: vLLM's auditor, alone or in an SM configuration:
   `audit+mps:16`) the engine's own metadata caught stale by
   the auditor. The attention-layer stale-audit is the harness's bookkeeping: it meets an
   `audit` control but never counts as a mode's evidence.
4. At least one positive control ran.
5. A known-bad build (`known-bad` controls, grouped by the first element of `Control.subject`: the build; the rest
   names the variant, a method and backend) shows evidence in at least one of its variants and modes; a silent one
   is listed (`GateDecision.misses`): whether the real defect faults outside the audit depends on memory leftovers
   (docs/policy.md), and a source mutant or a release is bad on its own capture path only (a DFlash builder's defect
   leaves EAGLE clean: results/h100-scenarios-mutants-0.33.0). A silent variant is listed only where some positive
   control of that path (`Control.variant`: a self control, the build in another mode) showed evidence in the run;
   a path nothing showed the bug on fails, as the build silent everywhere does. The mode still needs evidence from a
   positive control of its own (rule 3).
6. A self control outside the audit (`any-form` controls, grouped by `Control.subject`: build, method, backend, mode,
   repetition) shows kernel evidence in at least one of its injection forms; a silent form beside a caught one is
   listed (`GateDecision.form_misses`): whether a form faults depends on what the speculator's capture recomputes at
   replay (docs/policy.md: DFlash). In the audit mode every form is its own `audit` control (rule 1)."""

from __future__ import annotations

from collections.abc import Iterable

from repro.contract.verdicts import (
    CANNOT_VOUCH,
    CLEAN,
    ERROR,
    KERNEL_EVIDENCE,
    LAUNCH_FAIL,
    MEMORY_FAULTS,
    SKIP,
    STALE_AUDIT,
)
from repro.judge.control import (
    ANY_FORM,
    AUDIT,
    DETECTED,
    EXPECT_CLEAN,
    FAULT,
    KNOWN_BAD_BUILD,
    RECORDED,
    Control,
    GatingMode,
)
from repro.judge.decision import (
    CONTROL_FAILED,
    MODE_WITHOUT_EVIDENCE,
    MODE_WITHOUT_POSITIVE,
    NO_POSITIVE,
    NOT_COVERED,
    Failure,
    GateDecision,
)

MEETS: dict[str, tuple[str, ...]] = {
    # A launch that fails after stale metadata is the kernels failing too: upstream FA3's combine launch check reports
    # "Error Internal" there on the H200 (results/h200-launch-failures), where other configurations crash.
    FAULT: (*MEMORY_FAULTS, LAUNCH_FAIL),
    DETECTED: KERNEL_EVIDENCE,
    AUDIT: (*KERNEL_EVIDENCE, STALE_AUDIT),
    KNOWN_BAD_BUILD: (*KERNEL_EVIDENCE, STALE_AUDIT),  # STALE_AUDIT counts only where the audit is the engine's
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


def counts_as_evidence(verdict: str, mode: GatingMode) -> bool:
    """Does this verdict, from a positive control of `mode`, show that the mode sees the bug? Stale-audit only where
    the mode's audit is the engine's (GatingMode.engine_audit)."""
    return verdict in KERNEL_EVIDENCE or (verdict == STALE_AUDIT and mode.engine_audit)


def parse_requirements(text: str | None) -> frozenset[str]:
    """`mig,mps,vllm` -> the features a gate run must cover; ValueError names an unknown one."""
    names = {x.strip() for x in (text or "").split(",") if x.strip()}
    unknown = names - set(REQUIREMENTS)
    if unknown:
        raise ValueError(f"unknown gate requirement(s) {sorted(unknown)}; choose from {', '.join(REQUIREMENTS)}")
    return frozenset(names)


def disagrees(expect: str, verdict: str) -> bool:
    """A positive control that showed kernel evidence of another kind than its expectation names."""
    return is_positive(expect) and verdict in KERNEL_EVIDENCE and not satisfies(expect, verdict)


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
    bad_builds: dict[tuple[str, ...], list[Control]] = {}  # rule 5: subject -> its positive controls that ran
    forms: dict[tuple[str, ...], list[Control]] = {}  # rule 6: subject -> the forms of one self control that ran
    modes: dict[str, GatingMode] = {}  # each mode by the name its evidence is counted under
    seen: set[tuple[str, ...]] = set()  # rule 5: the paths (Control.variant) a positive control showed the bug on
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
            modes.setdefault(c.mode.name, c.mode)
            pos, ev = d.evidence.get(c.mode.name, (0, 0))
            if c.expected == ANY_FORM and c.verdict not in NO_EVIDENCE:  # without a subject: a form alone
                forms.setdefault(c.subject or (c.case_id,), []).append(c)
            elif c.subject is not None and is_positive(c.expected) and c.verdict not in NO_EVIDENCE:
                bad_builds.setdefault(c.subject, []).append(c)
            if is_positive(c.expected):
                shown = counts_as_evidence(c.verdict, c.mode)
                pos, ev = pos + 1, ev + shown
                if shown and c.variant:
                    seen.add(c.variant)
                if c.kind is not None:
                    kp, ke = d.evidence_by_kind.setdefault(c.mode.name, {}).get(c.kind, (0, 0))
                    d.evidence_by_kind[c.mode.name][c.kind] = (kp + 1, ke + shown)
            d.evidence[c.mode.name] = (pos, ev)
    _judge_bad_builds(d, bad_builds, seen)
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
            what = "kernel evidence" + (" or the engine's audit" if modes[mode].engine_audit else "")
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


def _variant(c: Control) -> str:
    return " ".join((c.subject or ())[1:])


def _judge_bad_builds(
    d: GateDecision, bad_builds: dict[tuple[str, ...], list[Control]], seen: set[tuple[str, ...]]
) -> None:
    """Rule 5 over each build (the subject's first element): none of its variants and modes showed evidence fails; a
    silent one beside evidence is listed, with the modes its own variant was detected in, else the variants that
    were, where a positive control of its path showed evidence (`seen`: Control.variant); else it fails."""
    builds: dict[str, list[Control]] = {}
    for subject, cs in bad_builds.items():
        builds.setdefault(subject[0], []).extend(cs)
    for build, cs in builds.items():
        shown = [c for c in cs if counts_as_evidence(c.verdict, c.mode)]
        silent = [c for c in cs if c.expected == KNOWN_BAD_BUILD and not counts_as_evidence(c.verdict, c.mode)]
        several = len({_variant(c) for c in cs}) > 1
        if silent and not shown:
            d.silent_builds.append(build)
            each = ", ".join(f"{_variant(c) + ' ' if several else ''}{c.mode}: {c.verdict}" for c in cs)
            d.failures.append(
                Failure(
                    f"{silent[0].case_id}: known-bad build {build} showed no evidence in any of its "
                    f"{'variants and ' if several else ''}modes ({each}): {silent[0].reason[:160]}",
                    CONTROL_FAILED,
                    silent[0].case_id,
                )
            )
            continue
        for c in silent:
            own = sorted({x.mode.name for x in shown if x.subject == c.subject})
            if own:
                d.misses.append(f"{c.case_id}: {c.verdict} (detected in {', '.join(own)})")
            elif c.variant is not None and c.variant not in seen:  # nothing showed the bug on this path
                d.failures.append(
                    Failure(
                        f"{c.case_id}: known-bad build {build} showed no evidence with {_variant(c) or 'this variant'}"
                        f", and no positive control of that path did ({' '.join(c.variant)}): {c.reason[:160]}",
                        CONTROL_FAILED,
                        c.case_id,
                    )
                )
            else:
                other = ", ".join(sorted({_variant(x) or x.mode.name for x in shown}))
                d.misses.append(
                    f"{c.case_id}: {c.verdict} (not with {_variant(c) or 'this variant'}; detected with {other})"
                )


def _judge_forms(d: GateDecision, forms: dict[tuple[str, ...], list[Control]]) -> None:
    """Rule 6: a self control none of whose forms showed evidence in its mode fails; a silent one beside another is listed."""
    for subject, cs in forms.items():
        shown = [c.case_id for c in cs if counts_as_evidence(c.verdict, c.mode)]
        silent = [c for c in cs if not counts_as_evidence(c.verdict, c.mode)]
        if not shown:
            d.failures.append(
                Failure(
                    f"{silent[0].case_id}: positive control came back {silent[0].verdict}: self control {' '.join(subject)} "
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
        KNOWN_BAD_BUILD: "a known-bad vLLM build: evidence in at least one of its modes and methods (a silent one is "
        "listed where a control of its path showed the bug)",
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
