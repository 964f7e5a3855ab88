"""Why a gate run cannot vouch, in the user's words, for the first line of its report: each cause with the SM
configurations it happened in and how many cases, e.g. "the platform computes wrong at mps:24 (4 cases); the
reference is untrusted at mps:56 (3 of 3 references: the platform there may compute wrong)". A cause is read from
each case's typed result alone (its verdict, its flags: a failed platform check, an untrusted reference, a CUDA error
classify found in its output, a self control that re-created no defect), never from the words of its reason."""

from __future__ import annotations

from collections import Counter

from repro.case.spec import CUDA_ERROR, RECREATED_NOTHING, UNTRUSTED_REFERENCE
from repro.contract.verdicts import CANNOT_VOUCH, CLEAN, ERROR, FAULTS, HANG, SKIP
from repro.judge.excerpt import shorten
from repro.vllm_integration.gate.judge import platform_failed
from repro.vllm_integration.gate.run import GateRun

PLATFORM = "the platform computes wrong"
UNTRUSTED = "the reference is untrusted"
NOT_FIRED = "a hook did not fire"
CUDA = "a CUDA error"
HUNG = "a case hung"
SKIPPED = "a case could not run here"
NO_RESULT = "a case ended without a result"
CONTROL = "a control showed nothing"
RECREATED = "a self control re-created no defect"
NOTHING_APPLIES = "none of the methods asked for applies to build"


def _where(sm) -> str:
    """An SM configuration as the user gives it (`--modes`): mps:56, sm_margin:20, or the full GPU."""
    return "the full GPU" if sm.kind == "full" else f"{sm.kind}:{sm.sms}" if sm.sms else sm.label


def cause(res, is_control: bool = False) -> str | None:
    """The cause, in the user's words, of a result that gives no answer either way; None for one that answers."""
    if res.not_applicable is not None:
        return None
    if platform_failed(res):
        return PLATFORM
    if UNTRUSTED_REFERENCE in res.flags:  # a reference its validation did not trust, or a case judged against one
        return UNTRUSTED
    if res.verdict == CANNOT_VOUCH:
        return RECREATED if RECREATED_NOTHING in res.flags else NOT_FIRED
    if res.verdict == HANG:
        return HUNG
    if res.verdict == SKIP:
        return SKIPPED
    if res.verdict == ERROR:
        return CUDA if CUDA_ERROR in res.flags else NO_RESULT
    if is_control and res.verdict == CLEAN:
        return CONTROL
    return None


def causes(run: GateRun) -> list[str]:
    """Each cause of a run that cannot vouch, most cases first, with where: '<cause> at <SM config> (N case(s))'."""
    seen: Counter = Counter()
    refs: Counter = Counter()
    for c, _r in run.references:
        refs[_where(c.mode.sm)] += 1
    for c, r in [*run.references, *run.cases]:
        if r.verdict in FAULTS and not c.is_control:
            continue  # the bug: AFFECTED, not a reason to be unable to vouch
        if (why := cause(r, c.is_control and not c.reference)) is not None:
            seen[(why, _where(c.mode.sm), c.reference)] += 1
    out = [f"{NOTHING_APPLIES} {label}: {why}" for label, why in run.unanswered().items()]
    for (why, sm, is_ref), n in seen.most_common():
        if not is_ref and why == UNTRUSTED and (UNTRUSTED, sm, True) in seen:
            continue  # its cases' cause is that reference's, said once
        if is_ref:
            every = n == refs[sm] and why == UNTRUSTED
            more = ": the platform there may compute wrong" if every and sm != "the full GPU" else ""
            out.append(f"{why} at {sm} ({n} of {refs[sm]} reference(s){more})")  # the SM config's own check
        else:
            out.append(f"{why} at {sm} ({n} case(s))")
    return out


def headline(run: GateRun) -> str:
    """' because: ...' for the headline of a run that cannot vouch ('' when no cause is known)."""
    found = causes(run)
    return f" because: {shorten('; '.join(found), 400)}" if found else ""
