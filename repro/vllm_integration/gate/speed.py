"""Gate speed records side by side (`python -m repro records --speed NAME ...`): for each recorded gate run
(results.json) or path comparison (paths.json, one row per path), its outcome, its wall, how long it waited for its
forkservers (0 when kept from an earlier run; "spawned" without), and the median seconds per
phase over the case processes that ran, each phase computed again from the record's own logs by
gate_bench.phases (so records written before a phase existed are split the same way as today's). A kept
reference ran no process and is not counted. The rows of two records, one above the other, are the comparison of a
benchmark with its previous record."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from repro.contract.channel import Channel, path_for
from repro.contract.tags import RESULT_TAG
from repro.vllm_integration.gate import bench as gate_bench
from repro.vllm_integration.gate.cache import KEPT_LINE, forkserver_ready
from repro.vllm_integration.gate.paths import path_folder

COLUMNS = ("import", "load", "compile", "jit", "capture", "engine_rest", "decode")


def _row(
    name: str,
    path: str,
    outcome: str,
    wall_s: float,
    logs: Path,
    walls: dict[str, float],
    launches: dict | None,
    command_s: float | None = None,
) -> dict:
    """One run's row: `walls` case id -> its process's wall (s) for the cases whose process ran."""
    per_case = []
    for case_id, wall in walls.items():
        log = logs / f"{case_id}.out.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        if not text or text.startswith(KEPT_LINE):  # a case that never started, or a kept reference (no process)
            continue
        result = Channel.read(path_for(log)).last(RESULT_TAG) if path_for(log).exists() else None
        per_case.append(gate_bench.phases(text, result, None, wall))
    med = {
        k: round(statistics.median(vals), 1)
        for k in ("wall", *COLUMNS)
        if (vals := [p[k] for p in per_case if isinstance(p.get(k), (int, float))])
    }
    ready = forkserver_ready(launches)
    return {
        "record": name,
        "path": path,
        "outcome": outcome,
        "wall_s": wall_s,
        "processes": len(per_case),
        "forkserver": ready,
        "command_s": command_s,
        **med,
    }


def record_rows(name: str, folder: Path) -> list[dict]:
    """The rows of one unpacked record folder: one per path of a comparison, else one for the gate run. ValueError
    when it holds neither a gate run nor a comparison."""
    if (folder / "paths.json").exists():
        doc = json.loads((folder / "paths.json").read_text())
        return [
            _row(
                name,
                p,
                r["outcome"],
                r["wall_s"],
                folder / "logs" / path_folder(p),
                {c: (e.get("phases") or {}).get("wall") or 0.0 for c, e in r["cases"].items()},
                r.get("launches"),
            )
            for p, r in doc["paths"].items()
        ]
    res = folder / "results.json"
    doc = json.loads(res.read_text()) if res.exists() else {}
    if doc.get("kind") != "vllm-gate" and "launches" not in doc:
        raise ValueError(f"{name}: neither a gate run (results.json of `repro gate`) nor a path comparison")
    walls = {c["case"]: c.get("wall_s") or 0.0 for c in doc.get("cases", []) + doc.get("references", [])}
    launches, command = doc.get("launches"), doc.get("command_s")  # command_s: absent from the older records
    return [_row(name, "gate", doc.get("outcome", "-"), doc.get("wall_s"), folder / "logs", walls, launches, command)]


def speed_table(rows: list[dict]) -> str:
    """The rows as one markdown table, in the order given."""
    head = "| record | path | outcome | command s | wall s | forkserver ready s | processes | median case s | "
    lines = [head + " | ".join(COLUMNS) + " |", "|" + "---|" * (8 + len(COLUMNS))]
    for r in rows:
        cells = " | ".join(f"{r[k]:.1f}" if k in r else "-" for k in COLUMNS)
        wall, cmd = (f"{r[k]:.1f}" if isinstance(r.get(k), (int, float)) else "-" for k in ("wall_s", "command_s"))
        median = f"{r['wall']:.1f}" if "wall" in r else "-"
        ready = "spawned" if r.get("forkserver") is None else f"{r['forkserver']:.1f}"
        lines.append(
            f"| {r['record']} | {r['path']} | {r['outcome']} | {cmd} | {wall} | {ready} | {r['processes']} | {median} | {cells} |"
        )
    return "\n".join(lines) + "\n"
