"""Verdict tables for people (Markdown), results for machines (JSON), and an optional heatmap image."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import fields
from pathlib import Path

from repro.case.spec import CaseResult, CaseSpec
from repro.contract.verdicts import KERNEL_EVIDENCE, VERDICTS, Verdict
from repro.errors import ConfigError
from repro.files import loads, read_bounded, write_whole
from repro.judge.control import Control
from repro.judge.decision import GateDecision
from repro.judge.expectations import gate_mode
from repro.judge.policy import decide, satisfies
from repro.report.records import upgrade_result
from repro.report.redact import redact
from repro.run.matrix import MatrixRun, expected_of

MARK = {True: "ok", False: "FAIL", None: "skip"}
NOT_ATTRIBUTED = "not attributed"  # kernel evidence whose faulting line named no kernel (memcheck or a
# CUDA_LAUNCH_BLOCKING=1 rerun names it: `matrix --sanitizer`)
GPU, MODEL = "gpu", "model"  # results.json "source": kernels ran, or the CPU model predicted
# 3: every case result whole, its typed flags included (CaseResult.flags); a record of an older schema is read through
# repro.report.records.upgrade_result, one of this schema never (a key it lacks is an error)
# 4: a case not applicable here says why in a field of its own (CaseResult.not_applicable), a failed platform check is
# a flag
# 5: an untrusted reference (and a case judged against one) and a CUDA error are flags
SCHEMA = 5
RESULT_KEYS = tuple(f.name for f in fields(CaseResult))


def _fields(r: CaseResult) -> str:
    if not r.stale_fields:
        return "-"
    return ", ".join(f"{k.replace('scheduler_metadata.', 'md.')}:{v}" for k, v in sorted(r.stale_fields.items()))


def rows(run: MatrixRun) -> list[dict]:
    out = []
    for s, r in run.results:
        exp = expected_of(s, r)
        out.append(
            {
                "case": s.case_id,
                "backend": s.backend,
                "strategy": s.strategy,
                "sm": s.sm.label,
                "mode": s.mode,
                "splits": s.cfg.num_splits,
                "poison": s.poison or "none",
                "sanitizer": s.sanitizer,
                "verdict": r.verdict,
                "evidence": r.evidence or "-",
                # a prediction names the kernel it predicts faults, or none (predicted wrong output: no fault)
                "kernel": r.kernel or (NOT_ATTRIBUTED if r.verdict in KERNEL_EVIDENCE and run.source != MODEL else "-"),
                "descriptor": r.descriptor or "-",
                "expected": exp,
                "ok": satisfies(exp, r.verdict),
                "stale_fields": r.stale_fields,
                "sms_planned": r.sms_planned,
                "sms_reported": r.sms_reported,
                "wall_s": r.wall_s,
                "reason": r.reason,
            }
        )
    return out


def header(title: str, env: dict | None = None) -> list[str]:
    """A report's title and its environment table (machine, GPU, driver, versions, command)."""
    lines = [f"# {title}", ""]
    if env:
        lines += ["| environment | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in env.items()] + [""]
    return lines


def markdown(run: MatrixRun, env: dict | None = None, title: str = "Verdicts") -> str:
    lines = header(title, env)
    counts = Counter(r.verdict for _, r in run.results)
    fails = run.failures()
    lines.append(
        f"{len(run.results)} cases in {run.wall_s:.1f} s; "
        + ", ".join(f"{k}: {v}" for k, v in counts.items())
        + f"; {len(fails)} unexpected"
        + (
            f" ({len(dis)} of them detected with kernel evidence of another kind than expected)"
            if (dis := run.disagreements())
            else ""
        )
        + (f"; first positive control after {run.first_positive_s} s" if run.first_positive_s is not None else "")
        + (
            f" ({run.first_positive_s + run.setup_s:.2f} s after the command started)."
            if run.first_positive_s is not None and run.setup_s is not None
            else "."
        )
    )
    lines += [
        "",
        "| case | verdict | evidence | kernel | descriptor | SMs planned | expected | met? | stale fields | s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows(run):
        lines.append(
            f"| {row['case']} | **{row['verdict']}** | {row['evidence']} | {row['kernel']} | {row['descriptor']} | "
            f"{row['sms_planned'] or '-'} | {row['expected']} | {MARK[row['ok']]} | "
            f"{_fields(next(r for s, r in run.results if s.case_id == row['case']))} | {row['wall_s']:.0f} |"
        )
    lines += ["", *legend(run)]
    lines += ["", "Reasons:", ""]
    seen = set()
    for s, r in run.results:
        if s.case_id not in seen:
            seen.add(s.case_id)
            lines.append(f"- `{s.case_id}`: {r.reason}")
    return redact("\n".join(lines)) + "\n"


def legend(run: MatrixRun) -> list[str]:
    """What the table's columns and words mean, for the rows this table has (one bullet each)."""
    model = run.source == MODEL
    lines = [
        "What the columns mean:",
        "",
        "- **met?**: does the verdict meet the expectation fixed before the case ran (`fault`: oob, crash or "
        "launch-failure; `detected`: any kernel evidence, wrong output included; `clean`: clean; all of them: "
        "repro/judge/policy.py)? ok, FAIL, or skip (the case did not run).",
        "- **descriptor**: the batch descriptor (tokens `t`, requests `r`) of the pass where the verdict arose.",
        "- **stale fields**: per buffer and decoded metadata field (`md.` = scheduler_metadata), the entries that "
        "differ from a fresh build for the same descriptor, summed over the passes that ran"
        + (" up to the predicted fault" if model else "")
        + "; `-`: none differed.",
    ]
    if any(s.strategy == "fresh" for s, _ in run.results):
        lines.append(
            "- **fresh** rows: the fresh strategy builds metadata for every pass, so no pass runs on stale metadata "
            "(stale fields `-`, `clean` expected); they show the harness does not fault on correct metadata."
        )
    if model:
        lines.append(
            "- Every row here is a **prediction of the CPU model**: no kernel ran. `oob` is the out-of-bounds read the "
            "model predicts (on a GPU, `oob` is a compute-sanitizer memcheck finding; without `--sanitizer` such a "
            "read shows as `crash`, a CUDA memory fault); `kernel` is the kernel the model predicts reads out of "
            "bounds first (`-`: none)."
        )
        if any(r.kernel == "main" for _, r in run.results):
            lines.append(
                "- Why `main` and not the split-KV combine kernel: without `--sanitizer`, upstream's combine over-read "
                "stays inside PyTorch's 2 MiB allocator segment and goes unseen, so the main kernel, sent out of bounds "
                "by metadata values no batch has, faults first (with `--sanitizer` memcheck sees the combine over-read "
                "where the launch's split count is below the combine's kMaxSplits: `combine`); vLLM's fork faults in "
                "its main kernel first either way (measured on an H200)."
            )
    if any(row["kernel"] == NOT_ATTRIBUTED for row in rows(run)):
        lines.append(
            f"- kernel **{NOT_ATTRIBUTED}**: the evidence names no kernel. A crash's faulting line (CUDA's error "
            "message) names none: `--sanitizer` (memcheck) or the vLLM gate's CUDA_LAUNCH_BLOCKING=1 rerun names it; "
            "wrong output or a hang names none either."
        )
    return lines


def write_json(run: MatrixRun, path: str | Path, env: dict | None = None) -> None:
    ids = {r["backend"]: None for r in rows(run)}
    for _, r in run.results:
        if r.backend_identity:
            ids[r.backend_identity["name"]] = r.backend_identity
    doc = {
        "schema": SCHEMA,
        "source": run.source,
        "environment": env or {},
        "backends": ids,
        "wall_s": run.wall_s,
        "first_positive_s": run.first_positive_s,
        "first_positive_case": run.first_positive_case,
        "setup_s": run.setup_s,
        "cases": [{**row, "result": r.to_dict()} for row, (_, r) in zip(rows(run), run.results)],
    }
    write_whole(path, redact(json.dumps(doc, indent=1, default=str)) + "\n")  # a regular file or a new one


VLLM_GATE_KIND = "vllm-gate"  # the "kind" of a results.json written by repro.vllm_integration.gate.report


def is_vllm_gate_record(path: str | Path) -> bool:
    """A results.json written by `repro gate` (kind VLLM_GATE_KIND), not by `matrix`."""
    data = read_bounded(path)  # a device, a fifo, a huge file: refused (ConfigError), never read without end
    try:
        doc = loads(data)
    except ConfigError:  # not JSON: load_json says so in its own words
        return False
    return isinstance(doc, dict) and doc.get("kind") == VLLM_GATE_KIND


def load_json(path: str | Path) -> MatrixRun:
    """A results.json written by `matrix` (GPU run or model prediction); ConfigError, one line, when it is not one."""

    try:
        data = read_bounded(path)  # a regular file of bounded size (ConfigError, one line)
        try:
            doc = loads(data, who="the file")  # bounded in depth
        except ConfigError as e:
            raise ValueError(str(e)) from None
        if not isinstance(doc, dict) or not isinstance(doc.get("cases"), list):
            raise ValueError("no 'cases' list")
        for key in ("wall_s", "first_positive_s", "setup_s"):  # numbers the reports compute with
            if doc.get(key) is not None and (isinstance(doc[key], bool) or not isinstance(doc[key], (int, float))):
                raise ValueError(f"its {key!r} is {type(doc[key]).__name__}, not a number of seconds")
        old = doc.get("schema", 1) < SCHEMA  # a recorded run of an older schema: through the one upgrader
        results = []
        for c in doc["cases"]:
            result = upgrade_result(c["result"], c) if old else c["result"]
            if missing := [k for k in RESULT_KEYS if k not in result]:
                raise ValueError(f"a case's result of schema {SCHEMA} has no {missing[0]!r} field")
            r = CaseResult(**result)
            results.append((CaseSpec.from_json(json.dumps(r.spec)), r))
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    except ConfigError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        why = f"a case has no {e.args[0]!r} field" if isinstance(e, KeyError) else str(e)  # never a bare 'cfg'
        raise ConfigError(f"{path}: not a results.json written by python -m repro matrix ({why})") from None
    return MatrixRun(
        results,
        doc.get("wall_s", 0.0),
        doc.get("first_positive_s"),
        doc.get("source", GPU),
        doc.get("first_positive_case"),
        setup_s=doc.get("setup_s"),
    )


def control_lines(run: MatrixRun, shown: int = 5) -> list[str]:
    """What the positive controls showed that a person must see, one line each: HARNESS BLIND counts only the
    controls without kernel evidence; a control detected with evidence of another kind than its expectation (wrong
    output where a fault was expected) is a disagreement, said on a line of its own. [] when neither happened."""
    lines = []
    if blind := run.blind_controls():
        lines.append(
            f"HARNESS BLIND: {len(blind)} positive control(s) not detected in this environment: "
            + ", ".join(s.case_id for s, _ in blind[:shown])
            + (f" (+{len(blind) - shown} more)" if len(blind) > shown else "")
        )
    if dis := run.disagreements():
        lines.append(
            f"DISAGREEMENT (detected, not blind): {len(dis)} positive control(s) showed kernel evidence of another "
            "kind than expected: "
            + ", ".join(f"{s.case_id}: {r.verdict}, expected {expected_of(s, r)}" for s, r in dis[:shown])
            + (f" (+{len(dis) - shown} more)" if len(dis) > shown else "")
        )
    return lines


def gate_decision(run: MatrixRun, required: frozenset[str] = frozenset()) -> GateDecision:
    """The strict gate over a matrix run (repro.judge.policy.decide), each case in its gating mode."""
    controls = [
        Control(s.case_id, expected_of(s, r), r.verdict, gate_mode(s), r.reason, not_applicable=None)
        for s, r in run.results
    ]
    return decide(controls, required)


def gate_failures(run: MatrixRun) -> list[str]:
    """Why a strict gate must fail (repro.judge.policy.decide); [] when it passes."""
    if not run.results:
        return ["no case ran"]
    return gate_decision(run).failures


VERDICT_COLORS = {  # one per verdict of repro.contract.verdicts.VERDICTS (a CPU test renders each)
    Verdict.CLEAN: "#4caf50",
    Verdict.OOB: "#f44336",
    Verdict.CRASH: "#b71c1c",
    Verdict.LAUNCH_FAIL: "#e65100",
    Verdict.HANG: "#6a1b9a",
    Verdict.WRONG: "#ffc107",
    Verdict.STALE_AUDIT: "#8bc34a",
    Verdict.CANNOT_VOUCH: "#90a4ae",
    Verdict.ERROR: "#607d8b",
    Verdict.SKIP: "#e0e0e0",
}


def heatmap(run: MatrixRun, path: str | Path) -> bool:
    """Verdicts by case group (rows) and SM configuration (columns). False when matplotlib is missing."""
    try:
        import matplotlib  # matplotlib only for heatmap.png, and optional (the gpu extra)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # as above
    except ImportError:
        return False
    order = list(VERDICTS)
    colors = [VERDICT_COLORS[v] for v in order]
    cols = sorted({s.sm.label for s, _ in run.results})
    rws = sorted({f"{s.backend}/{s.strategy}/{s.mode}/s{s.cfg.num_splits}" for s, _ in run.results})
    grid = [[order.index(Verdict.SKIP)] * len(cols) for _ in rws]
    for s, r in run.results:
        grid[rws.index(f"{s.backend}/{s.strategy}/{s.mode}/s{s.cfg.num_splits}")][cols.index(s.sm.label)] = order.index(
            r.verdict
        )
    from matplotlib.colors import ListedColormap  # as above

    fig, ax = plt.subplots(figsize=(2 + 1.4 * len(cols), 1 + 0.35 * len(rws)))
    ax.imshow(grid, cmap=ListedColormap(colors), vmin=0, vmax=len(order) - 1, aspect="auto")
    ax.set_xticks(range(len(cols)), cols)
    ax.set_yticks(range(len(rws)), rws)
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            ax.text(j, i, order[v], ha="center", va="center", fontsize=7)
    ax.set_title(
        "predicted by the CPU model (no kernels ran): verdict by case group and SM count"
        if run.source == MODEL
        else "verdict by case group and SM configuration"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
