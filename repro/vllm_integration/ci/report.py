"""`repro audit`'s report, in its folder as the gate's is (verdicts.md, results.json; `--junit FILE` on request) and
its last lines on the terminal: the gate's words, what they rest on (the FULL captures audited per capture manager,
the descriptor checks), each stale descriptor with its fields, the command's own exit status beside the answer, and
each process judged from its last snapshot (no exit report: judge.last_snapshot's words)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

from repro.files import write_whole
from repro.judge.decision import GateOutcome
from repro.vllm_integration.ci.judge import CommandStatus, Judgement

KIND = "repro-audit"  # results.json's `report`: what `--overwrite` and the JUnit check recognise as ours


def _stale_words(j: Judgement) -> str:
    """How many stale findings and how many distinct fields they name (a field is found stale at a forward of the
    capture and again at its end: each finding counts, the fields are named once)."""
    return f"stale findings: {j.stale_fields} (distinct fields: {j.distinct_stale_fields})"


def lines(j: Judgement, status: CommandStatus | None, code: int) -> list[str]:
    """The answer in words, the gate's first."""
    out = [f"repro audit: {j.outcome.value} (exit {code})"]
    if status is not None:
        out.append(f"command: {shlex.join(status.argv)}: {status.words} (its own status, kept apart from the audit's)")
    out.append(f"checks: {j.checks}, descriptor checks: {j.descriptor_checks}, {_stale_words(j)}")
    for mgr, n in sorted(j.full_by_manager.items()):
        out.append(
            f"  FULL captures by {mgr}: {n}, audited {j.audited_by_manager.get(mgr, 0)}, "
            f"stale {j.stale_by_manager.get(mgr, 0)}"
        )
    for who, method in sorted(j.methods.items()):
        out.append(f"  {who}: speculative method {method}")
    out += judged_lines(j)
    what = "stale" if j.outcome == GateOutcome.AFFECTED else "cannot vouch" if j.outcome != GateOutcome.PASS else None
    if what:
        out += [f"  {what}: {r}" for r in j.reasons]
    reporting = [p for p in j.processes if p.get("reported")]
    snap = f" ({len(j.snapshots)} by a snapshot only)" if j.snapshots else ""
    out.append(
        f"processes: {len(reporting)} reported{snap}, {len(j.processes) - len(reporting)} started and never reported"
    )
    out += [f"  {line}" for line in j.snapshots]
    return out


def judged_lines(j: Judgement) -> list[str]:
    """What the replay check and the refresh judging judged, in the gate's words; a PASS with 0 replays judged says
    that it rests on the capture-time checks alone."""
    out = []
    if j.replay:
        out.append(f"  replay check: {j.replay['words']}")
        if j.outcome == GateOutcome.PASS and not j.replay.get("judged"):
            out.append(
                "  (this PASS rests on the capture-time checks: 0 replays judged, so nothing was checked at replay)"
            )
    if j.refresh:
        out.append(f"  refresh judging: {j.refresh['words']}")
    return out


def markdown(j: Judgement, status: CommandStatus | None, code: int) -> str:
    out = ["# repro audit", "", f"**{j.outcome.value}** (exit {code})", ""]
    if status is not None:
        out += [f"Command: `{' '.join(status.argv)}`: {status.words} (its own status, kept apart from the audit's)", ""]
    out += ["| capture manager | FULL captures | audited | stale |", "|---|---|---|---|"]
    for mgr in sorted(set(j.full_by_manager) | set(j.audited_by_manager)):
        out.append(
            f"| {mgr} | {j.full_by_manager.get(mgr, 0)} | {j.audited_by_manager.get(mgr, 0)} | "
            f"{j.stale_by_manager.get(mgr, 0)} |"
        )
    out += ["", f"Checks {j.checks}, descriptor checks {j.descriptor_checks}, {_stale_words(j)}.", ""]
    out += [f"- {line.strip()}" for line in judged_lines(j)] + [""]
    if j.reasons:
        out += ["## Why" if j.outcome != GateOutcome.AFFECTED else "## Stale descriptors", ""]
        out += [f"- {r}" for r in j.reasons] + [""]
    out += [
        "## Processes",
        "",
        "| pid | process | checks | descriptor checks | stale | reported |",
        "|---|---|---|---|---|---|",
    ]
    for p in j.processes:
        said = f"snapshot only: {p['snapshot']}" if p.get("snapshot") else "yes"
        out.append(
            f"| {p.get('pid')} | {p.get('process')} | {p.get('checks', '')} | {p.get('descriptor_checks', '')} | "
            f"{p.get('stale', '')} | {said if p.get('reported') else 'no: died before its exit report'} |"
        )
    return "\n".join(out) + "\n"


def junit(j: Judgement, status: CommandStatus | None) -> str:
    """One testcase for the run's answer, and one per capture manager with FULL captures (a failure where stale)."""
    cases = []
    body = ""
    if j.outcome == GateOutcome.AFFECTED:
        body = f"<failure message={quoteattr('AFFECTED')}>{escape(chr(10).join(j.reasons))}</failure>"
    elif j.outcome != GateOutcome.PASS:
        body = f"<error message={quoteattr(str(j.outcome.value))}>{escape(chr(10).join(j.reasons))}</error>"
    cases.append(f'<testcase classname="repro.audit" name="audit">{body}</testcase>')
    for mgr, n in sorted(j.full_by_manager.items()):
        stale = j.stale_by_manager.get(mgr, 0)
        inner = f"<failure message={quoteattr(f'{stale} of {n} FULL captures stale')}/>" if stale else ""
        cases.append(f'<testcase classname={quoteattr("repro.audit." + mgr)} name="FULL captures">{inner}</testcase>')
    failures = sum("<failure" in c for c in cases)
    errors = sum("<error" in c for c in cases)
    return (
        '<?xml version="1.0" encoding="utf-8"?>\n'
        f'<testsuites><testsuite name="repro audit" tests="{len(cases)}" failures="{failures}" errors="{errors}">'
        + "".join(cases)
        + "</testsuite></testsuites>\n"
    )


def write(folder: Path, j: Judgement, status: CommandStatus | None, code: int, junit_file: str | None) -> None:
    """verdicts.md and results.json into the report folder, each whole; the JUnit file where asked."""
    doc = {
        "report": KIND,
        "outcome": j.outcome.value,
        "exit_code": int(code),
        "command": None if status is None else {**status.__dict__, "argv": list(status.argv), "words": status.words},
        "judgement": j.to_dict(),
        "audit_file": "audit/audit.json",
    }
    write_whole(folder / "results.json", json.dumps(doc, indent=1) + "\n")
    write_whole(folder / "verdicts.md", markdown(j, status, code))
    if junit_file:
        write_whole(junit_file, junit(j, status))
