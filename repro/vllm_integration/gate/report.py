"""The gate's answer for people (verdicts.md: per build, affected or not, the evidence per mode, what vLLM resolved and
the hooks counted, so a PASS shows what it checked) and machines (results.json: the rows, results, environment)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from repro.case.spec import RECREATED_NOTHING
from repro.contract.verdicts import FAULTS, SKIP
from repro.files import write_whole
from repro.judge.control import KNOWN_BAD, SELF_CONTROL
from repro.judge.decision import GateOutcome
from repro.judge.excerpt import shorten
from repro.judge.policy import NO_EVIDENCE
from repro.report.redact import redact
from repro.report.results import VLLM_GATE_KIND, header
from repro.vllm_integration.gate import bench as gate_bench
from repro.vllm_integration.gate.cache import COLD, KEPT, PRIVATE, WARM
from repro.vllm_integration.gate.case import expected
from repro.vllm_integration.gate.checked import (
    acceptance_cell,
    captures_cell,
    config_cell,
    coverage,
    judged_cell,
    kinds_cell,
)
from repro.vllm_integration.gate.judge import passes
from repro.vllm_integration.gate.methods import DEFAULT_METHOD
from repro.vllm_integration.gate.outcome import GateRun, control_of
from repro.vllm_integration.gate.why import headline as cannot_vouch_why
from repro.vllm_integration.plugin.inject import STALE_CAPTURE
from repro.vllm_integration.releases import release_range
from repro.vllm_integration.releases.source_check import check_tree

RESULTS_KIND = VLLM_GATE_KIND
TITLE = "vLLM gate: is this vLLM build affected by the stale-metadata capture bug?"
NO_GPU = "no_gpu"  # the environment's caveat where the builds ran without a GPU (stand-ins): shown under the headline


def _oks(run: GateRun) -> dict[str, bool]:
    """Each case's ok: not applicable, or it met its expectation and the run's stored decision fails no control of its
    subject (a failure names one control; policy rules 5 and 6 fail every mode or form of its subject with it), and,
    for a known-bad build, the build showed evidence somewhere (rule 5 fails a build silent everywhere: every row)."""
    decision = run.judged().decision
    subject = {c.case_id: control_of(c, r).subject or c.case_id for c, r in run.cases}
    hit = {subject[f.case_id] for f in decision.failures if f.case_id in subject}
    silent = set(decision.silent_builds)  # rule 5 failed these builds whole: every row
    ok = {
        c.case_id: passes(c, r)
        and subject[c.case_id] not in hit
        and not (c.control_kind == KNOWN_BAD and c.build.label in silent)
        for c, r in run.cases
    }
    return {c.case_id: bool(r.not_applicable) or ok[c.case_id] for c, r in run.cases}


def rows(run: GateRun) -> list[dict]:
    out, oks = [], _oks(run)
    kinds = {"case": run.cases, "reference": run.references, "attribution": run.attributions, "attempt": run.attempts}
    for kind, pairs in kinds.items():
        for c, r in pairs:
            out.append(
                {
                    "case": c.case_id,
                    "kind": kind,
                    "build": c.build.label,
                    "role": c.build.role,
                    "vllm_version": r.vllm_version or c.build.version,
                    "method": c.method,
                    "mode": "reference" if c.reference else c.mode.name,
                    "sm": c.mode.sm.label,
                    "rep": c.rep,
                    "verdict": r.verdict,
                    "evidence": r.evidence or "-",
                    "kernel": r.kernel or "-",
                    "descriptor": r.descriptor or "-",
                    "expected": (r.expected or expected(c)) if kind == "case" else "-",
                    "ok": oks[c.case_id] if kind == "case" else None,
                    "engine": (r.backend_identity or {}).get("engine"),
                    "counters": (r.backend_identity or {}).get("counters"),
                    "acceptance": (r.backend_identity or {}).get("acceptance"),
                    "device": (r.backend_identity or {}).get("device"),  # where it ran (placement), when placed
                    "stale_fields": r.stale_fields,
                    "wall_s": r.wall_s,
                    "reason": r.reason,
                    # a case's every process (its attempts: gate.process.Attempt), none for a reference or a rerun
                    "attempts": [a.to_dict() for a in run.attempted.get(c.case_id, ())] if kind == "case" else [],
                }
            )
    return out


def caches(run: GateRun, label: str) -> str:
    """Whether a build's cases ran warm (every case on the build's complete vLLM cache, its reference kept), cold
    (a case compiled, or the reference ran), or on the old path (no cache): what its wall time means."""
    states = [
        (r.phases or {}).get("vllm_cache")
        for c, r in [*run.cases, *run.references, *run.attributions]
        if c.build.label == label and r.verdict != SKIP  # a skipped case ran nothing
    ]
    if not states or any(s in (None, PRIVATE) for s in states):
        return "old path"
    return WARM if all(s in (WARM, KEPT) for s in states) else COLD


def build_summary(run: GateRun) -> list[dict]:
    """One line per build and speculative method (EAGLE's row carries the build's label alone): affected or not, in
    which modes, with how many repetitions; a method the build lacks is a row that says so (not_applicable)."""
    by_build: dict[str, list] = defaultdict(list)
    for c, r in run.cases:  # a build's self control is a row of its own: a positive control, never the build's answer
        method = "" if c.method == DEFAULT_METHOD else f" {c.method}"
        form = "" if c.inject == STALE_CAPTURE else f", {c.inject}"  # the second form's row says which it is
        by_build[c.build.label + method + (f" (self control{form})" if c.inject else "")].append((c, r))
    out, oks = [], _oks(run)
    for label, pairs in by_build.items():
        b = pairs[0][0].build
        injected, modes = pairs[0][0].inject is not None, defaultdict(list)
        for c, r in pairs:
            modes[c.mode.name].append(r.verdict)
        detected = sorted(m for m, vs in modes.items() if any(v in FAULTS for v in vs))
        unsure = sorted(m for m, vs in modes.items() if any(v in NO_EVIDENCE for v in vs))
        if b.prefix and b.prefix not in run.source_checks:  # each report reads it: the tree parsed once a run
            run.source_checks[b.prefix] = check_tree(b.prefix).verdict
        out.append(
            {
                "build": label,
                "method": pairs[0][0].method,
                "not_applicable": pairs[0][1].not_applicable,
                "role": SELF_CONTROL if injected else b.role,
                "vllm_version": next((r.vllm_version for _, r in pairs if r.vllm_version), b.version)
                or "unknown (no case reported it)",
                "affected": bool(detected),
                "detected_in": detected,
                "could_not_vouch": unsure,
                "recreated_nothing": any(RECREATED_NOTHING in r.flags for _, r in pairs),  # a self control's (vouch)
                "modes": {m: vs for m, vs in modes.items()},
                "source_check": run.source_checks.get(b.prefix or "", "-"),
                "wall_s": run.build_wall_s.get(b.label),
                "caches": caches(run, b.label),
                "ok": all(oks[c.case_id] for c, _ in pairs),
                "coverage": coverage(pairs),
            }
        )
    return out


def fidelity(run: GateRun) -> list[dict]:
    """The injection's fidelity: per mode, every positive control side by side (known-bad builds as they are, and
    self controls: builds with the defect re-created), with the verdict, the kernel, the first stale descriptor and
    the stale fields. Empty unless both kinds ran."""
    cases = [(c, r) for c, r in run.cases if c.is_control]
    if len({c.control_kind for c, _ in cases}) < 2:
        return []
    return [
        {
            "mode": c.mode.name,
            "control": f"{c.build.label} {'injected' if c.inject else 'as it is'}",
            "kind": c.control_kind,
            "verdict": r.verdict,
            "kernel": r.kernel,
            "descriptor": r.descriptor,
            "stale_fields": r.stale_fields or {},
            "evidence": r.evidence,
        }
        for c, r in sorted(cases, key=lambda cr: (cr[0].mode.name, cr[0].inject is not None, cr[0].build.label))
    ]


def fidelity_markdown(run: GateRun) -> list[str]:
    rows_ = fidelity(run)
    if not rows_:
        return []
    lines = [
        "",
        "Self control beside the real defect (per mode: each positive control's verdict, kernel named, first stale "
        "descriptor, stale fields):",
        "",
        "| mode | control | verdict | kernel | first stale descriptor | stale fields |",
        "|---|---|---|---|---|---|",
    ]
    for x in rows_:
        fields = ", ".join(f"{k} {v}" for k, v in sorted(x["stale_fields"].items())) or "-"
        lines.append(
            f"| {x['mode']} | {x['control']} | {x['verdict']} | {x['kernel'] or '-'} | {x['descriptor'] or '-'} | "
            f"{fields} |"
        )
    return lines


def releases_only(summaries: list[dict]) -> list[dict]:
    """The builds as releases (the release range): no self-control rows, nor a method's where the build lacks it."""
    return [s for s in summaries if s["role"] != SELF_CONTROL and not s.get("not_applicable")]


def markdown(run: GateRun, env: dict | None = None, terminal: bool = False) -> str:
    """verdicts.md: the run's stored answer (GateRun.judged), its builds, cases and what each checked. `terminal`: what
    `gate` prints of it, the same lines (the headline and env's no-GPU line under it) up to its per-case tables, without
    its environment table."""
    lines = header(TITLE, None if terminal else env)
    lines += _answer(run, env) + _checked(run)
    if terminal:
        return redact("\n".join(lines)) + "\n"
    return redact("\n".join(lines + _per_case(run))) + "\n"


def _answer(run: GateRun, env: dict | None) -> list[str]:
    """verdicts.md's first part: the headline, each build's answer, the release range, what blinds or keeps the run
    from vouching, the policy's summary, the fidelity checks, MPS reruns and how the processes started."""
    lines: list[str] = []
    j, ran = run.judged(), f"{len(run.cases)} cases, {len(run.references)} references, {run.wall_s:.0f} s wall"
    verdict, no_gpu = j.outcome, f"\n\n**No GPU: {env[NO_GPU]}**" if (env or {}).get(NO_GPU) else ""
    because = cannot_vouch_why(run) if verdict == GateOutcome.CANNOT_VOUCH else ""  # its cause, in the user's words
    lines += [f"**Gate: {verdict}**{because} ({ran}){no_gpu}", ""]
    lines += _builds_table(run)
    lines += [""] + release_range.markdown(releases_only(build_summary(run)))
    if j.blind and verdict != GateOutcome.BLIND:  # one headline per outcome: HARNESS BLIND only when it is the outcome
        lines.append(f"\nAlso, under this {verdict} outcome (it comes first), controls without evidence:")
    for why in j.blind:
        lines.append(
            f"\nHARNESS BLIND: {why}" if verdict == GateOutcome.BLIND else f"- {why.replace('GATE FAILED: ', '')}"
        )
    lines += [f"\nCANNOT VOUCH: {c.case_id}: {shorten(r.reason)}" for c, r in run.not_vouched()]
    summary = j.decision.summary()
    if not j.need_control:  # the builds answer for themselves: their cases are not controls
        summary[0] = f"gate: {len(run.cases)} case(s) ran; no positive control needed (--no-control)"
    lines += [""] + summary
    lines += fidelity_markdown(run)
    if run.mps_reruns:  # MPS cases run again (their result is the last run's; the logs before kept beside it)
        lines.append(
            "\nRan again under MPS (the earlier run's logs kept as <case>.<attempt>.*): "
            + ", ".join(f"{r['case']} (after {r['attempt before']})" for r in run.mps_reruns)
        )
    if run.launches:  # how the case processes started, and every fallback from the launcher asked for
        lines += ["", "How the case processes started:", ""] + gate_bench.launch_lines({"": run})
    return lines


def _builds_table(run: GateRun) -> list[str]:
    """One row per build: its role, whether it is affected and where the bug was detected, its verdicts per mode."""
    lines: list[str] = []
    lines += [
        "| build | role | vLLM | affected | detected in | verdicts per mode | source check | wall s (caches) | ok |"
    ]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for s in build_summary(run):
        per_mode = "; ".join(f"{m}: {', '.join(vs)}" for m, vs in s["modes"].items())
        if s.get("not_applicable"):  # the build lacks the method: no answer either way, and no failure
            answer = "not applicable"
            per_mode = s["not_applicable"]
        elif s["role"] == SELF_CONTROL:  # a positive control: was the re-created defect caught?
            answer = _control_answer(s)
        elif not s["affected"] and s["could_not_vouch"] and len(s["could_not_vouch"]) == len(s["modes"]):
            answer = "cannot tell"  # no case of the build gave an answer either way
        else:
            answer = "yes" if s["affected"] else "no"
        lines.append(
            f"| {s['build']} | {s['role']} | {s['vllm_version']} | **{answer}** | "
            f"{', '.join(s['detected_in']) or '-'} | {per_mode} | {s['source_check']} | {s['wall_s']} ({s['caches']}) | "
            f"{'ok' if s['ok'] else 'FAIL'} |"
        )
    return lines


def _control_answer(s: dict) -> str:
    """A self control's row: caught where a mode showed the defect; NOT caught only where a mode answered without
    showing it; where no mode answered, never NOT caught (that claims the auditor missed a defect): no defect
    re-created (a case flagged RECREATED_NOTHING by gate.judge.vouch), else cannot tell."""
    if s["affected"]:
        return "defect re-created: caught"
    if any(v not in NO_EVIDENCE for vs in s["modes"].values() for v in vs):  # one repetition answered: a miss
        return "defect re-created: NOT caught"
    return "no defect re-created: cannot vouch" if s["recreated_nothing"] else "cannot tell"


def _checked(run: GateRun) -> list[str]:
    """What each build's cases checked: counters, captures per kind and per capture manager (the terminal's last part)."""
    lines: list[str] = []
    lines += [
        "",
        "What each build's cases checked (sums over its cases; captures per graph kind as "
        "total/with an attention forward/audited at capture end/stale):",
        "",
        "| build | configuration seen | captures per kind | audit checks | views checked | attention forwards "
        "(FA version) | sm_margin calls (sched/fwd) | entries poisoned | acceptance | judged at replay / refresh |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in build_summary(run):
        cov = s["coverage"]
        seen = "; ".join(f"{k} {'/'.join(str(v) for v in vs)}" for k, vs in cov["config"].items() if vs)
        lines.append(
            f"| {s['build']} | {seen or 'not reported (no case reached generate)'} | {captures_cell(cov)} | {cov['checks']} | {cov['views_checked']} | "
            f"{cov['attention_forwards']} ({kinds_cell(cov['fa_versions'])}) | {cov['sched_sm_margin']}/"
            f"{cov['fwd_sm_margin']} | {cov['entries_poisoned']} | {acceptance_cell(cov['acceptance'])} | "
            f"{judged_cell(cov)} |"
        )
    lines += ["", "Captures per capture manager (total/FULL/injected by the self control), per build and method:", ""]
    lines += ["| build | captures per capture manager |", "|---|---|"]
    for s in build_summary(run):
        per = "; ".join(f"{m} {'/'.join(map(str, n))}" for m, n in sorted(s["coverage"]["managers"].items()))
        lines.append(f"| {s['build']} | {per or 'none reported'} |")
    return lines


def _per_case(run: GateRun) -> list[str]:
    """verdicts.md's per-case tables: what each case checked, its verdict and evidence, and every reason."""
    lines: list[str] = []
    lines += [
        "",
        "| case | configuration | captures per kind | checks | views | forwards | sm_margin sched/fwd | poisoned | "
        "acceptance |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(run):
        if row["kind"] != "case":
            continue
        c = row["counters"] or {}
        lines.append(
            f"| {row['case']} | {config_cell(row['engine'])} | {captures_cell(c)} | {c.get('checks', '-')} | "
            f"{c.get('views_checked', '-')} | {c.get('attention_forwards', '-')} ({kinds_cell(c.get('fa_versions') or {})})"
            f" | {c.get('sched_sm_margin', '-')}/{c.get('fwd_sm_margin', '-')} | {c.get('entries_poisoned', '-')} | "
            f"{acceptance_cell(row['acceptance'])} |"
        )
    lines += [
        "",
        "| case | verdict | evidence | kernel | descriptor | expected | met? | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(run):
        mark = {True: "ok", False: "FAIL", None: ""}[row["ok"]]
        lines.append(
            f"| {row['case']} | **{row['verdict']}** | {row['evidence']} | {row['kernel']} | {row['descriptor']} | "
            f"{row['expected']} | {mark} | {row['wall_s']:.0f} |"
        )
    lines += ["", "Reasons:", ""] + [f"- `{row['case']}`: {row['reason']}" for row in rows(run)]
    return lines


def to_json(run: GateRun, env: dict | None = None) -> dict:
    """results.json: the run's stored answer (GateRun.judged) and every record."""
    j = run.judged()
    pairs = (*run.cases, *run.references, *run.attributions, *run.attempts)
    results = {c.case_id: r.to_dict() for c, r in pairs}
    return {
        "kind": RESULTS_KIND,
        "environment": env or {},
        "outcome": j.outcome,
        "need_control": j.need_control,
        "passed": j.outcome == GateOutcome.PASS,
        "affected": [c.case_id for c, _ in run.affected()],
        "cannot_vouch": [c.case_id for c, _ in run.not_vouched()],
        "blind": list(j.blind),
        "decision": j.decision.summary(),
        **{"wall_s": run.wall_s, "setup_s": run.setup_s, "command_s": run.command_s},
        "launches": run.launches,
        "mps_reruns": run.mps_reruns,
        "builds": build_summary(run),
        "release_range": release_range.to_json(releases_only(build_summary(run))),
        "cases": [{**row, "result": results[row["case"]]} for row in rows(run)],
        "fidelity": fidelity(run),
    }


def write(run: GateRun, out_dir: str | Path, env: dict | None = None) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "verdicts.md", out / "results.json"
    write_whole(md, markdown(run, env))  # each a regular file or a new one, whole
    write_whole(js, redact(json.dumps(to_json(run, env), indent=1, default=str)) + "\n")
    return [md, js]
