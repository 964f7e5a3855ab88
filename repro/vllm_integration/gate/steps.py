"""A gate case's judging as one declared, ordered list of named steps (STEPS). A step's name is the word the record's
history says for it (CaseResult.revised's step); its phase (`when`) says which of the three moments runs it; each
phase runs its steps in the list's order (judged), never a sequence written by hand:

- ENDED, when the case's process ended (annotate, called by gate.process.run_case): the record completed with what
  the process and the plugin reported, then the first check that finds something decides the record (a hook's error,
  the MPS SM count, the platform's GEMM check, a hang before the captures, the auditor's stale views);
- READ, when a reference's RESULT record is read, before any case is compared with it (validate, called by run_gate's
  record): its validation;
- KNOWN, once the case's reference is known (finish, called by run_gate and by a self control's early judging): the
  token comparison, the draft's acceptance, what fired (coverage).

A skip is judged by no later step. The rules themselves are gate.judge's (and gate.coverage's)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from repro.case.spec import CAPTURING, PLATFORM_FAILED, STALLED, CaseResult, mps_sm_mismatch
from repro.contract.channel import Channel
from repro.contract.tags import COUNTERS_TAG, DEVICE_TAG, ENGINE_TAG, PLUGIN_TAG, RESULT_TAG
from repro.contract.verdicts import CLEAN, CRASH, ERROR, HANG, KERNEL_EVIDENCE, OOB, SKIP, STALE_AUDIT
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.coverage import features_needed
from repro.vllm_integration.gate.judge import (
    HUNG_EARLY,
    PLATFORM_CHECK,
    apply_reference,
    audit_evidence,
    compare_acceptance,
    ended_without_result,
    platform_problem,
    validate_reference,
    vouch,
)

ENDED, READ, KNOWN = "its process ended", "its reference's record read", "its reference known"  # the phases, in order


@dataclass(frozen=True)
class Facts:
    """What a phase judges a record by: its case, and what that phase knows."""

    case: GateCase
    ch: Channel | None = None  # ENDED: the process's channel records
    audit: dict | None = None  # ENDED: what the auditor reported (judge.audit_evidence)
    out: dict | None = None  # READ, KNOWN: the process's RESULT record
    ref: CaseResult | None = None  # KNOWN: the reference's result
    ref_out: dict | None = None  # KNOWN: the reference's RESULT record


@dataclass(frozen=True)
class Step:
    name: str  # the word its record's history says (CaseResult.revised's step)
    when: str  # its phase: ENDED, READ or KNOWN
    fn: Callable[[Facts, CaseResult], CaseResult]  # the record after it: the same one where it does not apply
    why: str  # what it judges, in words
    ends: bool = False  # a new record it made is judged by no later step of its phase (the first finding decides)


def complete(f: Facts, res: CaseResult) -> CaseResult:
    """The shared classification completed with what the case process and the plugin reported on the channel (vLLM's
    version, the engine's record, counters and acceptance, a self control's injection records, the auditor's stale
    views, the evidence in words); no verdict or reason changes here."""
    case, ch, audit = f.case, f.ch, f.audit
    result = ch.last(RESULT_TAG) or {}
    plugin = ch.of(PLUGIN_TAG)
    engine, counters = ch.last(ENGINE_TAG), ch.last(COUNTERS_TAG)
    identity = res.backend_identity
    if engine or counters:
        e = dict(engine or {})
        identity = {
            "engine": {k: v for k, v in e.items() if k not in ("counters", "acceptance")},
            "counters": e.get("counters") or counters or {},
            "acceptance": e.get("acceptance"),
        }
    if case.inject:  # the injection's own records, written as it wrote: they survive a fault or a hang after them
        identity = {**(identity or {}), "injection": [p for p in plugin if "injection_wrote" in p]}
    # without CUDA_LAUNCH_BLOCKING=1 a crash surfaces at any later call: not attributed (with it, classify named the
    # kernel from the first fault line only)
    kernel = None if res.verdict == CRASH and not case.launch_blocking else res.kernel
    evidence = []
    if res.verdict in KERNEL_EVIDENCE:
        evidence.append(res.evidence + (f", {kernel} kernel" if kernel else ""))
    if case.mode.sanitizer and res.verdict not in (OOB, SKIP):
        evidence.append("memcheck: no finding")
    if case.mode.audit and not case.reference:
        by_descriptor = f" ({audit['descriptor']} of them stale-descriptor)" if audit["descriptor"] else ""
        checked = f" and {audit['descriptor_checks']} descriptor checks" if audit["descriptor_checks"] else ""
        evidence.append(f"audit: {audit['stale']} stale fields{by_descriptor} in {audit['checks']} checks{checked}")
    return replace(
        res,
        vllm_version=result.get("vllm_version") or case.build.version,
        kernel=kernel,
        backend_identity=identity,
        stale_fields=audit["fields"] if audit["stale"] else res.stale_fields,
        first_diffs=audit["first"] if audit["stale"] else res.first_diffs,
        evidence="; ".join(evidence) or None,
    )


def plugin_check(f: Facts, res: CaseResult) -> CaseResult:
    """An install error of any hook, under any tag, or a feature coverage.NEEDS asks that was never installed: an
    error (or, for a process stopped before vLLM loaded its plugins, an error that says so)."""
    case, ch = f.case, f.ch
    result, plugin = ch.last(RESULT_TAG) or {}, ch.of(PLUGIN_TAG)
    installed = {p["installed"] for p in plugin if "installed" in p}
    needed = features_needed(case)  # coverage.NEEDS
    errors = ch.errors()  # an install error of any hook, under any tag, reaches the verdict
    missing = needed - installed
    if not (errors or (missing and (result or plugin))):
        return res
    what = "; ".join(errors) or (
        # stopped before vLLM loads its plugins (a memcheck case's own start can take its whole timeout): no
        # sign that the plugin is missing, and no evidence about the build either
        f"the process was stopped before vLLM loaded the repro plugin (features {sorted(missing)} never installed)"
        if res.verdict == HANG and not result and installed <= {"own_allocator"}  # (the worker's own, not vLLM's)
        else f"plugin features {sorted(missing)} not installed: vLLM did not load the repro plugin through its "
        "entry point (python -m pip install -e <this project> in the environment that runs vLLM)"
    )
    why = f"{what} (case verdict would have been {res.verdict}: {res.reason})"
    return res.revised("plugin", "a hook reported an error or was not installed", verdict=ERROR, reason=why)


def mps_check(f: Facts, res: CaseResult) -> CaseResult:
    """An MPS case whose process saw another SM count than it asked for: an error."""
    devices = f.ch.of(DEVICE_TAG)
    if devices and (why := mps_sm_mismatch(f.case.mode.sm, devices[-1].get("sms"))):
        return res.revised("MPS SM count", why, verdict=ERROR, reason=why)
    return res


def platform_check(f: Facts, res: CaseResult) -> CaseResult:
    """A process whose GPU computed bf16 matrix products wrong in its SM configuration (judge.platform_problem)."""
    devices = f.ch.of(DEVICE_TAG)
    if devices and (why := platform_problem(devices[-1])):
        return res.revised(PLATFORM_CHECK, why, verdict=ERROR, reason=why, flags=[*res.flags, PLATFORM_FAILED])
    return res


def hang_check(f: Facts, res: CaseResult) -> CaseResult:
    """A hang whose output never showed the captures begun (no flag STALLED or CAPTURING): an error, no evidence."""
    # no sign its captures had begun: neither vLLM's words nor a stale capture the auditor counted
    if res.verdict == HANG and not {STALLED, CAPTURING} & set(res.flags) and not f.audit["stale"]:
        why = f"{res.reason}, before vLLM began capturing CUDA graphs: no evidence about the captures"
        return res.revised(HUNG_EARLY, why, verdict=ERROR, reason=why)
    return res


def audit_check(f: Facts, res: CaseResult) -> CaseResult:
    """Stale views the auditor caught decide the record however its process ended: a clean run becomes stale-audit, a
    process that ended without a result (an error in any library, an exit or kill before its RESULT record, memory it
    could not get) becomes stale-audit with that end quoted, a crash's or hang's reason says so. The counts reported
    before the end are what the auditor saw; how the process ended after them takes nothing away."""
    audit = f.audit
    if res.verdict == CLEAN and audit["stale"]:
        why = f"no fault this run, but the auditor caught stale views: {audit['first'][0]}"
        return res.revised("audit", why, verdict=STALE_AUDIT, reason=why, descriptor=audit["first_descriptor"])
    if res.verdict == ERROR and audit["stale"]:
        why = f"the auditor caught stale views before the process ended ({res.reason}): {audit['first'][0]}"
        return res.revised(
            "audit",
            "the auditor's count decides a process that ended without a result",
            verdict=STALE_AUDIT,
            reason=why,
            descriptor=res.descriptor or audit["first_descriptor"],
        )
    if audit["stale"] and res.verdict in (CRASH, HANG):
        return res.revised(
            "audit",
            "the auditor saw stale views before the fault",
            reason=res.reason + f"; the auditor caught stale views before it: {audit['first'][0]}",
            descriptor=res.descriptor or audit["first_descriptor"],
        )
    return res


def acceptance_check(f: Facts, res: CaseResult) -> CaseResult:
    """The draft's acceptance against the reference's, once the tokens compared found nothing wrong."""
    judged = res.verdict in (CLEAN, STALE_AUDIT) and not ended_without_result(res)  # a process that ended early
    return compare_acceptance(res, f.ref) if judged else res  # reported no acceptance: its audit count decides


# every step of a gate case's judging, in the order they run; docs/architecture.md lists them (a test keeps the two
# equal), and a history shows them in this order
STEPS = (
    Step("annotation", ENDED, complete, "the record completed with what the process and the plugin reported"),
    Step("plugin", ENDED, plugin_check, "a hook's install error, or a needed feature not installed", ends=True),
    Step("MPS SM count", ENDED, mps_check, "MPS gave another SM count than asked", ends=True),
    Step(PLATFORM_CHECK, ENDED, platform_check, "the GPU computes bf16 products wrong here", ends=True),
    Step(HUNG_EARLY, ENDED, hang_check, "a hang before vLLM began capturing", ends=True),
    Step("audit", ENDED, audit_check, "the auditor's stale views, however the process ended", ends=True),
    Step(
        "reference validation",
        READ,
        lambda f, res: validate_reference(f.case, res, f.out),
        "a clean reference checked before it is trusted",
    ),
    Step(
        "reference comparison",
        KNOWN,
        lambda f, res: apply_reference(res, f.out, f.ref, f.ref_out),
        "the greedy tokens against the reference's",
    ),
    Step("draft acceptance", KNOWN, acceptance_check, "the draft's acceptance against the reference's"),
    Step("coverage", KNOWN, lambda f, res: vouch(f.case, res), "what must have fired to vouch"),
)


def judged(when: str, facts: Facts, res: CaseResult) -> CaseResult:
    """The record after every step of the phase `when`, in STEPS's order; each step makes a new record or returns
    the one it was given."""
    for step in STEPS:
        if step.when != when:
            continue
        new = step.fn(facts, res)
        if new.verdict == SKIP or (step.ends and new is not res):
            return new
        res = new
    return res


def annotate(res: CaseResult, case: GateCase, output: str | Channel, audit_file: Path | None) -> CaseResult:
    """The gate's record of a case whose process ended (the steps of ENDED): the shared classification with what the
    case process and the plugin reported on the channel (`output`: a Channel, or a log's text), revised where that
    changes the verdict."""
    ch = output if isinstance(output, Channel) else Channel.from_output(output)
    return judged(ENDED, Facts(case, ch=ch, audit=audit_evidence(ch, audit_file)), res)


def validate(case: GateCase, res: CaseResult, out: dict | None) -> CaseResult:
    """A reference's record once its RESULT record was read (the steps of READ): validated before it is trusted."""
    return judged(READ, Facts(case, out=out), res)


def finish(case: GateCase, res: CaseResult, out: dict | None, ref: CaseResult, ref_out: dict | None) -> CaseResult:
    """A finished case judged once its reference is known (the steps of KNOWN): the comparison, the draft's acceptance,
    then what fired (vouch); each a new record."""
    return judged(KNOWN, Facts(case, out=out, ref=ref, ref_out=ref_out), res)
