"""The rules a finished gate case is judged by, each step a function that returns a new record (CaseResult.revised):
the auditor's evidence (audit_evidence) and the platform's GEMM check (platform_problem) the annotation reads, a
reference's validation (validate_reference), the comparison with the build's reference (apply_reference,
compare_tokens), the draft's acceptance (compare_acceptance), what fired (vouch, over gate.coverage).
repro.vllm_integration.gate.steps declares the steps and their order and runs them; `passes` is the policy's answer
for the final record."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from repro.attention.staleness import count_fields
from repro.case.spec import CUDA_ERROR, PLATFORM_FAILED, RECREATED_NOTHING, UNTRUSTED_REFERENCE, CaseResult
from repro.contract.channel import ACCEPTANCE, CONFIGURATION, Channel, recorded_before
from repro.contract.tags import AUDIT_TAG
from repro.contract.verdicts import CANNOT_VOUCH as NOT_VOUCHED
from repro.contract.verdicts import CLEAN, ERROR, SKIP, STALE_AUDIT, WRONG
from repro.judge import policy
from repro.vllm_integration.gate.case import GateCase, expected
from repro.vllm_integration.gate.coverage import applying, descriptor_check_existed, not_fired, recreated_nothing
from repro.vllm_integration.plugin.audit import STALE_DESCRIPTOR, in_words

TIE_MARGIN = 0.1  # nats: a reference token whose top-2 margin is below this is a tie, not a reference
MIN_COVERAGE = 0.5  # a comparison that covers less than this share of the tokens cannot vouch for a build
# a speculative reference (no CUDA graphs) accepting below MIN_ACCEPTANCE cannot judge a draft; a case accepting over
# ACCEPTANCE_DROP below its reference has a silently wrong draft (the gate's weights: 100% right, near 0% stale)
MIN_ACCEPTANCE, ACCEPTANCE_DROP = 0.5, 0.15


def acceptance_of(identity: dict | None) -> tuple[int, int] | None:
    """(accepted draft tokens, draft tokens) from vLLM's counters in a case's record; None when not reported."""
    acc = (identity or {}).get("acceptance") or {}
    accepted, drafted = acc.get("spec_decode_num_accepted_tokens"), acc.get("spec_decode_num_draft_tokens")
    if not isinstance(accepted, (int, float)) or not isinstance(drafted, (int, float)):
        return None
    return int(accepted), int(drafted)


def acceptance_rate(a: tuple[int, int] | None) -> float | None:
    """The share of draft tokens accepted; None without counters or without a draft token."""
    return a[0] / a[1] if a and a[1] else None


def describe_acceptance(a: tuple[int, int] | None) -> str:
    if a is None:
        return "not reported"
    return f"{a[0]} of {a[1]} draft tokens accepted ({acceptance_rate(a):.0%})" if a[1] else "0 draft tokens"


HUNG_EARLY = "hang before capture"  # the step of a hang whose output never showed the captures begun (annotate)
PLATFORM_CHECK = "platform check"  # the step of a result whose process's GPU failed the GEMM check (platform_problem)


def platform_failed(res: CaseResult) -> bool:
    """Did this result's process find its platform computing matrix products wrong (annotate, platform_problem)? The
    same MPS SM configuration on the same GPU does so for every process (results/h200-mps24-gemm-check-*: every
    process at 24 SMs; h200-sweep-mps-b: both that ran at 40). Its typed flag, set by the step that found it."""
    return PLATFORM_FAILED in res.flags


def platform_problem(device: dict) -> str | None:
    """Why nothing computed in this case's process can be judged: its GPU, in this SM configuration, computes bf16
    matrix products wrong (gate.gemm_check; measured under MPS at 24 SMs on the H200: results/h200-mps-gemm-probe).
    None when the check passed or was not reported."""
    chk = device.get("gemm_check") or {}
    if chk.get("ok") is not False:
        return None
    return (
        f"this GPU computes bf16 matrix products wrong here ({device.get('sms')} SMs: max error {chk.get('max_error')} "
        f"against float32 for {chk.get('worst')}, tolerance {chk.get('tolerance')}): nothing computed in this SM "
        "configuration can be judged, the build's answer here is unknown"
    )


def audit_evidence(ch: Channel, audit_file: Path | None) -> dict:
    """What the auditor reported for the case: its mismatches (the audit file, else the AUDIT records; how many were
    stale-descriptor), checks, descriptor checks, stale views per field, the first three in words, the first's."""
    lines = ch.of(AUDIT_TAG)
    stale = [x["stale"] for x in lines if "stale" in x and isinstance(x["stale"], dict)]
    checks = descriptor_checks = 0
    if audit_file is not None:
        try:
            report = json.loads(audit_file.read_text())
            checks, descriptor_checks = int(report.get("checks", 0)), int(report.get("descriptor_checks", 0))
            stale = report.get("mismatches", stale) or stale
        except (OSError, ValueError):
            pass
    summaries = [x for x in lines if "checks" in x]
    if summaries:
        checks = max(checks, int(summaries[-1]["checks"]))
        descriptor_checks = max(descriptor_checks, int(summaries[-1].get("descriptor_checks", 0)))
    fields = count_fields((m["buffer"], m["field"]) for m in stale)  # stale views per field: see count_fields
    first = [in_words(m) for m in stale[:3]]
    return {
        "stale": len(stale),
        "descriptor": sum(1 for m in stale if m.get("kind") == STALE_DESCRIPTOR),
        "checks": checks,
        "descriptor_checks": descriptor_checks,
        "fields": fields,
        "first": first,
        "first_descriptor": stale[0]["descriptor"] if stale else None,
    }


def vouch(case: GateCase, res: CaseResult) -> CaseResult:
    """A clean or stale-audit case whose feature did not fire becomes cannot-vouch; kernel evidence stays, except in a
    self control whose injection never wrote before it or, in an audit mode, that the auditor caught nothing of. A self
    control that re-created no defect (coverage.recreated_nothing) cannot vouch whatever it showed: flagged
    RECREATED_NOTHING, its cause for reports (gate.why), never read from its reason."""
    if case.reference or res.verdict in (ERROR, SKIP):  # no evidence to discount, nothing fired to vouch for
        return res
    counters = (res.backend_identity or {}).get("counters") or {}
    nothing = recreated_nothing(case, counters)
    if res.verdict not in (CLEAN, STALE_AUDIT) or ended_without_result(res):
        blind = case.mode.audit and not res.stale_fields and descriptor_check_existed(counters)
        wrote = (res.backend_identity or {}).get("injection")
        missing = [f"the self control's injection never wrote before this {res.verdict}: not the re-created defect's"]
        if not case.inject or wrote and not blind:
            missing = []
        elif wrote:
            missing = [f"the auditor caught nothing of the re-created defect ({case.inject}): the {res.verdict} alone"]
    else:
        missing = not_fired(case, res.backend_identity)
    if nothing is not None:
        missing = [nothing, *missing]
    if not missing:
        return res
    reason = f"{'; '.join(missing)} (case verdict would have been {res.verdict}: {res.reason[:200]})"
    flags = [*res.flags, RECREATED_NOTHING] if nothing is not None else res.flags
    return res.revised("coverage", "; ".join(missing), verdict=NOT_VOUCHED, reason=reason, flags=flags)


def ended_without_result(res: CaseResult) -> bool:
    """Is this a stale-audit record of a process that did not end with its result (classify's first verdict was not
    clean or stale-audit: a fault in a library, a kill, a hang, an exit before its RESULT record)? The auditor's count, reported before that
    end, is its evidence, as a fault is a crash's: what only a whole run reports (the engine record, the counters at
    exit) is not asked of it."""
    if res.verdict != STALE_AUDIT:
        return False
    first = res.first_verdict
    return first not in (CLEAN, STALE_AUDIT)  # STALE_AUDIT: classify's own, for a process that printed its result


def _reports_configuration(out: dict | None) -> bool | None:
    """Does a reference's RESULT record report its configuration (True), come from before that existed as the
    replays' upgrader marked it (False), or lack it with no such mark (None: a live record missing its key)?"""
    if "nonfinite" in (out or {}):
        return True
    return False if CONFIGURATION in recorded_before(out) else None


DEGENERATE_MIN = 4  # tokens: a request of at least this many that repeats one token after the first is degenerate


def reference_problems(case: GateCase, res: CaseResult, out: dict | None) -> list[str]:
    """Why a finished reference must not be trusted, empty when it may: tokens decoded, finite log-probabilities with
    top-2 margins, no request one token repeated, no CUDA graphs, a draft accepting MIN_ACCEPTANCE, and the case's SM
    configuration (MPS: the SM count seen; sm_margin: the margin reached FA3)."""
    if not out or not out.get("tokens"):
        return ["the reference run decoded no tokens"]
    problems = []
    nonfinite = out.get("nonfinite") or []
    if nonfinite:
        problems.append(
            f"non-finite log-probabilities (NaN or inf logits) at {len(nonfinite)} position(s), first {nonfinite[0]}"
        )
    missing = [
        f"request {i} token {j}"
        for i, ms in enumerate(out.get("margins") or [[None] * len(t) for t in out["tokens"]])
        for j, m in enumerate(ms)
        if m is None or not math.isfinite(m)
    ]
    if missing and not nonfinite:
        problems.append(f"no finite top-2 margin at {len(missing)} position(s), first {missing[0]}")
    for i, toks in enumerate(out["tokens"]):
        if len(toks) >= DEGENERATE_MIN and len(set(toks[1:])) == 1:
            problems.append(f"request {i} decodes {toks[0]} then repeats {toks[1]} (a degenerate reference)")
            break
    identity = res.backend_identity or {}
    e, c = identity.get("engine"), identity.get("counters") or {}
    reports = _reports_configuration(out)
    if reports is None:  # a live record without the key: its worker did not check what a reference must show
        return problems + ["the reference's RESULT record lacks 'nonfinite': its configuration is unchecked"]
    if not reports:  # a recorded run from before the validation (the upgrader's mark): its tokens are all it shows
        return problems
    if not e:
        problems.append("the reference reported no engine configuration (no REPRO_ENGINE record)")
    else:
        if e.get("speculative_method") or e.get("num_speculative_tokens"):
            acc = acceptance_of(identity)
            rate = acceptance_rate(acc)
            if rate is None or rate < MIN_ACCEPTANCE:
                problems.append(
                    f"the reference's draft (no CUDA graphs): {describe_acceptance(acc)}, below "
                    f"{MIN_ACCEPTANCE:.0%}: the draft does not agree with the target, so acceptance cannot tell a "
                    "wrong draft"
                )
        if e.get("cudagraph_mode") not in (None, "NONE"):
            problems.append(f"the reference ran with CUDA graphs (cudagraph mode {e.get('cudagraph_mode')})")
    if case.mode.sm.kind == "sm_margin" and any(n.short(c) for n in applying(case, reference=True)):
        problems.append(
            f"the reference's SM configuration sm_margin:{case.mode.sm.sms} did not reach FA3 "
            f"({c.get('sched_sm_margin', 0)} get_scheduler_metadata and {c.get('fwd_sm_margin', 0)} forward calls "
            "received the margin)"
        )
    return problems


def validate_reference(case: GateCase, res: CaseResult, out: dict | None) -> CaseResult:
    """A clean reference run checked before it is trusted (reference_problems): a broken one becomes an error (a new
    record), so every case judged against it cannot vouch instead of reading as wrong output."""
    if res.verdict != CLEAN:
        return res
    problems = reference_problems(case, res, out)
    if not problems and not _reports_configuration(out):
        return res  # a record from before references reported their configuration: its tokens checked, nothing to add
    if not problems:
        margins = [m for ms in (out or {}).get("margins") or [] for m in ms if m is not None]
        smallest = f", smallest top-2 margin {min(margins):.3f} nats" if margins else ""
        acc = acceptance_of(res.backend_identity)
        drafted = f", draft {describe_acceptance(acc)}" if acc else ""
        what = (
            f"reference validated: {sum(len(t) for t in out['tokens'])} tokens, finite, not degenerate{smallest}"
            f"{drafted}"
        )
        return res.revised("reference validation", what, evidence="; ".join(x for x in (res.evidence, what) if x))
    why = "reference not trusted: " + "; ".join(problems)
    flags = [*res.flags, UNTRUSTED_REFERENCE]  # typed: what is judged later (gate.why) never reads these words
    return res.revised("reference validation", why, verdict=ERROR, reason=why, flags=flags)


@dataclass
class TokenCheck:
    compared: int = 0  # positions compared (up to the first tie or difference of each request)
    total: int = 0
    ties: int = 0  # requests whose comparison stopped at a near-tied reference token
    wrong: list[str] = field(default_factory=list)
    worst_margin: float | None = None  # largest reference margin among the wrong tokens (nats)

    @property
    def coverage(self) -> float:
        return self.compared / self.total if self.total else 0.0

    def describe(self) -> str:
        s = f"tokens: {self.compared} of {self.total} compared equal to the reference"
        if self.ties:
            s += f", {self.ties} request(s) stopped at a near tie (< {TIE_MARGIN} nats)"
        if self.wrong:
            s += f"; {len(self.wrong)} differ where the reference was decided: {self.wrong[0]}"
        return s


def compare_tokens(
    tokens: list[list[int]], ref_tokens: list[list[int]], ref_margins: list[list[float | None]] | None
) -> TokenCheck:
    """Greedy tokens of the speculative, graph-captured run against the reference. A difference where the reference's
    top-2 log-probability margin is below TIE_MARGIN is a tie (numerics may pick either): the request stops being
    compared there. A difference where the reference was decided is wrong output; the margin is the measured error."""
    c = TokenCheck(total=sum(len(r) for r in ref_tokens))
    for i, (got, want) in enumerate(zip(tokens, ref_tokens)):
        margins = ref_margins[i] if ref_margins and i < len(ref_margins) else []
        for j, w in enumerate(want):
            g = got[j] if j < len(got) else None
            if g == w:
                c.compared += 1
                continue
            m = margins[j] if j < len(margins) else None
            if m is not None and m < TIE_MARGIN:
                c.ties += 1
            else:
                c.wrong.append(f"request {i} token {j}: {g}, reference {w} (reference margin {m} nats)")
                if m is not None:
                    c.worst_margin = max(c.worst_margin or 0.0, m)
            break
    return c


# What a case judged against a reference that gave no answer keeps of that reference's typed flags: the cause it has
# no answer for (an untrusted reference, a CUDA error in the reference's process), read by gate.why as its own.
CARRIED_FROM_REFERENCE = (UNTRUSTED_REFERENCE, CUDA_ERROR)


def apply_reference(res: CaseResult, out: dict | None, ref: CaseResult, ref_out: dict | None) -> CaseResult:
    """A finished speculative case judged against its reference (a new record): wrong-output where the greedy tokens
    differ where the reference was decided, error without a reference or with too many near ties.
    out, ref_out: the RESULT records of the two processes (result_line)."""
    if res.verdict not in (CLEAN, STALE_AUDIT) or ended_without_result(res):  # no tokens: nothing to compare
        return res
    step = "reference comparison"
    if ref.verdict != CLEAN or not ref_out or not out:
        why = f"no reference to compare with ({ref.case_id}: {ref.verdict}: {ref.reason[:200]})"
        carried = [f for f in ref.flags if f in CARRIED_FROM_REFERENCE and f not in res.flags]
        return res.revised(step, why, verdict=ERROR, reason=why, flags=[*res.flags, *carried])
    sms, ref_sms = ((x.get("device") or {}).get("sms") for x in (out, ref_out))
    if sms is not None and ref_sms is not None and sms != ref_sms:
        why = f"the reference ran on {ref_sms} SMs, this case on {sms}: not the same SM configuration"
        return res.revised(step, why, verdict=ERROR, reason=why)
    chk = compare_tokens(out["tokens"], ref_out["tokens"], ref_out.get("margins"))
    evidence = "; ".join(x for x in (res.evidence, chk.describe()) if x)
    if chk.wrong:
        why = f"greedy tokens differ from the reference where it was decided: {chk.wrong[0]}"
        return res.revised(step, why, verdict=WRONG, max_abs_err=chk.worst_margin, reason=why, evidence=evidence)
    if chk.coverage < MIN_COVERAGE and res.verdict == CLEAN:
        why = f"the reference comparison covered {chk.compared} of {chk.total} tokens: too many near ties"
        return res.revised(step, why, verdict=ERROR, reason=why, evidence=evidence)
    return res.revised(step, chk.describe(), evidence=evidence)


def compare_acceptance(res: CaseResult, ref: CaseResult) -> CaseResult:
    """The draft judged by what the target accepted: wrong-output more than ACCEPTANCE_DROP below its reference's;
    cannot-vouch when the case or its reference reported none while the other did (nothing to judge it by); neither
    (no speculation): the record as it was."""
    step = "draft acceptance"
    want = acceptance_of(ref.backend_identity)
    got = acceptance_of(res.backend_identity)
    engine = (ref.backend_identity or {}).get("engine")  # a reference from before the ENGINE record: none
    if acceptance_rate(want) is None and (
        acceptance_rate(got) is None or not engine or ACCEPTANCE in recorded_before(engine)
    ):
        return res  # no draft in either (no speculation, no decode), or a recorded reference from before it ran one
    if acceptance_rate(want) is None or acceptance_rate(got) is None:
        who, said = ("its reference", want) if acceptance_rate(want) is None else ("the case", got)
        why = f"{who} reported {describe_acceptance(said)}: the draft cannot be judged against the reference's"
        return res.revised(step, why, verdict=NOT_VOUCHED, reason=why)
    line = f"draft: {describe_acceptance(got)}, reference {acceptance_rate(want):.0%}"
    evidence = "; ".join(x for x in (res.evidence, line) if x)
    if acceptance_rate(got) < acceptance_rate(want) - ACCEPTANCE_DROP:
        why = (
            f"the draft is silently wrong: {describe_acceptance(got)} with CUDA graphs, "
            f"{describe_acceptance(want)} without (same build and SM configuration)"
        )
        return res.revised(step, why, verdict=WRONG, reason=why, evidence=evidence)
    return res.revised(step, line, evidence=evidence)


def passes(case: GateCase, res: CaseResult) -> bool:
    """Does the case pass the gate (repro.judge.policy.problem is None for its expectation, the one stored in the
    result, else computed)? A positive control passes with any kernel evidence, not only the kind it expected."""
    return policy.problem(res.expected or expected(case), res.verdict) is None
