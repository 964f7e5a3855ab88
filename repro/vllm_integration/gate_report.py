"""The gate's answer for people (verdicts.md: per build, is it affected, and the evidence per mode) and for machines
(results.json: the same rows, every case's full result, environment and command)."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from repro.redact import redact
from repro.vllm_integration.gate_run import NO_CONTROL, PASS, GateRun, expected, meets
from repro.vllm_integration.source_check import check_tree

RESULTS_KIND = "vllm-gate"


def rows(run: GateRun) -> list[dict]:
    out = []
    for kind, pairs in (("case", run.cases), ("reference", run.references), ("attribution", run.attributions)):
        for c, r in pairs:
            out.append(
                {
                    "case": c.case_id,
                    "kind": kind,
                    "build": c.build.label,
                    "role": c.build.role,
                    "vllm_version": r.vllm_version or c.build.version,
                    "mode": "reference" if c.reference else c.mode.name,
                    "sm": c.mode.sm.label,
                    "rep": c.rep,
                    "verdict": r.verdict,
                    "evidence": r.evidence or "-",
                    "kernel": r.kernel or "-",
                    "descriptor": r.descriptor or "-",
                    "expected": expected(c) if kind == "case" else "-",
                    "ok": meets(c, r) if kind == "case" else None,
                    "stale_fields": r.stale_fields,
                    "wall_s": r.wall_s,
                    "reason": r.reason,
                }
            )
    return out


def build_summary(run: GateRun) -> list[dict]:
    """One line per build: affected or not, in which modes, with how many repetitions."""
    by_build: dict[str, list] = defaultdict(list)
    for c, r in run.cases:
        by_build[c.build.label].append((c, r))
    out = []
    for label, pairs in by_build.items():
        b = pairs[0][0].build
        modes: dict[str, list[str]] = defaultdict(list)
        for c, r in pairs:
            modes[c.mode.name].append(r.verdict)
        detected = sorted(m for m, vs in modes.items() if any(v not in ("clean", "error", "skip") for v in vs))
        unsure = sorted(m for m, vs in modes.items() if any(v in ("error", "skip") for v in vs))
        src = check_tree(b.prefix) if b.prefix else None
        out.append(
            {
                "build": label,
                "role": b.role,
                "vllm_version": next((r.vllm_version for _, r in pairs if r.vllm_version), b.version),
                "affected": bool(detected),
                "detected_in": detected,
                "could_not_vouch": unsure,
                "modes": {m: vs for m, vs in modes.items()},
                "source_check": src.verdict if src else "-",
                "wall_s": run.build_wall_s.get(label),
                "ok": all(meets(c, r) for c, r in pairs),
            }
        )
    return out


def markdown(run: GateRun, env: dict | None = None, need_control: bool = True) -> str:
    lines = ["# vLLM gate: is this vLLM build affected by the stale-metadata capture bug?", ""]
    if env:
        lines += ["| environment | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items()] + [""]
    verdict = run.outcome(need_control)
    lines += [
        f"**Gate: {verdict}** ({len(run.cases)} cases, {len(run.references)} references, {run.wall_s:.0f} s wall)",
        "",
    ]
    lines += ["| build | role | vLLM | affected | detected in | verdicts per mode | source check | wall s | ok |"]
    lines += ["|---|---|---|---|---|---|---|---|---|"]
    for s in build_summary(run):
        per_mode = "; ".join(f"{m}: {', '.join(vs)}" for m, vs in s["modes"].items())
        lines.append(
            f"| {s['build']} | {s['role']} | {s['vllm_version']} | **{'yes' if s['affected'] else 'no'}** | "
            f"{', '.join(s['detected_in']) or '-'} | {per_mode} | {s['source_check']} | {s['wall_s']} | "
            f"{'ok' if s['ok'] else 'FAIL'} |"
        )
    for why in run.blind():
        if need_control or not why.startswith(NO_CONTROL):
            lines.append(f"\nHARNESS BLIND: {why}")
    lines += [
        "",
        "| case | verdict | evidence | kernel | descriptor | expected | | s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(run):
        mark = {True: "ok", False: "FAIL", None: ""}[row["ok"]]
        lines.append(
            f"| {row['case']} | **{row['verdict']}** | {row['evidence']} | {row['kernel']} | {row['descriptor']} | "
            f"{row['expected']} | {mark} | {row['wall_s']:.0f} |"
        )
    lines += ["", "Reasons:", ""] + [f"- `{row['case']}`: {row['reason']}" for row in rows(run)]
    return redact("\n".join(lines)) + "\n"


def to_json(run: GateRun, env: dict | None = None, need_control: bool = True) -> dict:
    results = {c.case_id: r.to_dict() for pairs in (run.cases, run.references, run.attributions) for c, r in pairs}
    return {
        "kind": RESULTS_KIND,
        "environment": env or {},
        "outcome": run.outcome(need_control),
        "passed": run.outcome(need_control) == PASS,
        "affected": [c.case_id for c, _ in run.affected()],
        "blind": run.blind(),
        "wall_s": run.wall_s,
        "builds": build_summary(run),
        "cases": [{**row, "result": results[row["case"]]} for row in rows(run)],
    }


def write(run: GateRun, out_dir: str | Path, env: dict | None = None, need_control: bool = True) -> list[Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    md, js = out / "verdicts.md", out / "results.json"
    md.write_text(markdown(run, env, need_control))
    js.write_text(redact(json.dumps(to_json(run, env, need_control), indent=1, default=str)) + "\n")
    return [md, js]
