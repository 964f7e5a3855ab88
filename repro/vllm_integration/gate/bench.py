"""Where a vLLM gate case's time goes, and the old path against the new one.

phases(): a case process's wall split into process start, import (torch, vllm), engine start (of which: config and
model-registry inspection, torch.compile, CUDA graph capture, the rest of the engine's init), decode (generate) and
teardown, from the case's RESULT record (timing_s, written by repro.vllm_integration.gate.worker) and vLLM's own log lines.
A phase vLLM did not log is absent, never guessed; a case that crashed has no RESULT: only its log's phases and wall.

compare_markdown(): `repro gate --compare-paths` runs the same builds and modes on the old path (every case cold:
private vLLM caches, every reference run) and on the new path (repro.vllm_integration.gate.cache: shared per-build
vLLM caches, references kept by build fingerprint), first cold (an empty cache folder), then warm; one table per
path and build, the phases per case, and the verdict differences between the paths."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable

from repro.contract.verdicts import ERROR, SKIP
from repro.vllm_integration.gate.judge import passes

_STAMP = re.compile(r"^(?:INFO|WARNING|DEBUG|ERROR) (\d\d-\d\d \d\d:\d\d:\d\d)")
_COMPILE = re.compile(r"torch\.compile (?:took|takes) ([\d.]+) s in total")
_CAPTURE = re.compile(r"Graph capturing finished in ([\d.]+) secs")
_INIT = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
_LOADED = re.compile(r"Directly load (?:AOT compilation|the compiled graph)")
_LOAD = re.compile(r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds")  # weights, the plugin's included
_JIT = re.compile(r"JIT kernel warmup finished in ([\d.]+)s")  # vLLM's Triton warmup kernels (0.34.0: 92 keys)
_CONFIG_START, _CONFIG_END = "non-default args", "Initializing a V1 LLM engine"
PHASES = ("start", "import", "cuda", "config", "load", "compile", "jit", "capture", "engine_rest", "decode", "teardown")
_IN_ENGINE = ("config", "load", "compile", "jit", "capture")  # the engine's start, less these: engine_rest


def _stamp(line: str, year: int) -> float | None:
    m = _STAMP.match(line)
    if not m:
        return None
    try:
        return time.mktime(time.strptime(f"{year}-{m[1]}", "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return None


def log_phases(log_text: str) -> dict:
    """What vLLM's log says: config_s (from its argument line to the engine's init line: config resolution and the
    model registry's inspection of the target and draft classes, 1 s resolution), compile_s (torch.compile, summed
    over the models), capture_s (graph capture, whole seconds as vLLM logs them), init_engine_s, and
    compile_loaded (artifacts vLLM loaded from its cache instead of compiling)."""
    out: dict = {}
    start = end = None
    year = time.gmtime().tm_year
    compile_s = capture_s = load_s = jit_s = 0.0
    n_compile = n_capture = n_load = n_jit = loaded = 0
    for line in log_text.splitlines():
        if _CONFIG_START in line and start is None:
            start = _stamp(line, year)
        elif _CONFIG_END in line and end is None:
            end = _stamp(line, year)
        if m := _COMPILE.search(line):
            compile_s += float(m[1])
            n_compile += 1
        if m := _CAPTURE.search(line):
            capture_s += float(m[1])
            n_capture += 1
        if m := _LOAD.search(line):
            load_s += float(m[1])
            n_load += 1
        if m := _JIT.search(line):
            jit_s += float(m[1])
            n_jit += 1
        if m := _INIT.search(line):
            out["init_engine_s"] = float(m[1])
        if _LOADED.search(line):
            loaded += 1
    if start is not None and end is not None and end >= start:
        out["config_s"] = end - start
    if n_compile:
        out["compile_s"] = round(compile_s, 2)
    if n_capture:
        out["capture_s"] = capture_s
    if n_load:
        out["load_s"] = round(load_s, 2)
    if n_jit:
        out["jit_s"] = round(jit_s, 2)
    out["compile_loaded"] = loaded
    return out


def phases(
    log_text: str, result: dict | None, started_at: float | None, wall_s: float, device: dict | None = None
) -> dict:
    """Seconds per phase of one case process (PHASES; absent where unknown) and its wall. `import` is torch and
    vLLM's import and `cuda` CUDA's start with the GEMM check where the case split them (its RESULT record, or its
    DEVICE record for a case that ended without a result); a record from before the split has them in `import`."""
    p: dict = {"wall": round(wall_s, 1)}
    lp = log_phases(log_text)
    timing = (result or {}).get("timing_s") or {}
    if started_at and timing.get("main_at"):
        p["start"] = round(timing["main_at"] - started_at, 1)
    split = timing if "cuda_init" in timing else (device or {}).get("startup_s") or {}
    if "cuda_init" in split:
        p["import"] = round(split["torch_import"] + split["vllm_import"], 1)
        p["cuda"] = round(split["cuda_init"], 1)
    elif "import" in timing:
        p["import"] = timing["import"]
    for k in _IN_ENGINE:
        if f"{k}_s" in lp:
            p[k] = lp[f"{k}_s"]
    if "engine" in timing:
        known = sum(p.get(k, 0.0) for k in _IN_ENGINE)
        p["engine"] = timing["engine"]
        p["engine_rest"] = round(max(0.0, timing["engine"] - known), 1)
    if "generate" in timing:
        p["decode"] = timing["generate"]
    if started_at and timing.get("done_at"):
        p["teardown"] = round(max(0.0, started_at + wall_s - timing["done_at"]), 1)
    p["compile_loaded"] = lp["compile_loaded"]
    return p


def _fmt(v) -> str:
    return "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))


def phase_table(rows: Iterable[tuple[str, str, str, dict | None, str]]) -> list[str]:
    """Rows of (path, case id, verdict, phases, caches) as a markdown table; `launcher` says how the process
    started (fork, spawn; `spawn*`: the fork was asked for and the case launched plainly, its record says why)."""
    out = [
        "| path | case | verdict | caches | launcher | wall | " + " | ".join(PHASES) + " | compile loaded |",
        "|---|---|---|---|---|---|" + "---|" * len(PHASES) + "---|",
    ]
    for path, case_id, verdict, ph, caches in rows:
        ph = ph or {}
        cells = " | ".join(_fmt(ph.get(k)) for k in PHASES)
        launcher = (ph.get("launcher") or "-") + ("*" if ph.get("launch_note") else "")
        out.append(
            f"| {path} | {case_id} | {verdict} | {caches} | {launcher} | {_fmt(ph.get('wall'))} | {cells} | "
            f"{_fmt(ph.get('compile_loaded'))} |"
        )
    return out


def launch_lines(runs: dict) -> list[str]:
    """Per path and build: how its case processes started (GateRun.launches), the forkserver's one import, and
    every note (a fallback to the plain launch is never silent)."""
    out = []
    for name, run in runs.items():
        for label, s in sorted(run.launches.items()):
            fs = s.get("forkserver")
            what = f"{s['forked']} forked, {s['spawned']} spawned"
            if fs:
                what += (
                    f"; forkserver imported in {fs['import_s']:.1f} s, ready {fs['ready_after_s']:.1f} s after start"
                )
                if kept := fs.get("kept"):  # gate_keep: the import was an earlier run's, or is kept for a later one
                    what += "; kept: " + ("taken from an earlier run" if kept.get("reused") else "started, kept")
                    what += f" (idle {kept.get('idle_s'):.0f} s)"
            out.append(f"- {name + ': ' if name else ''}build {label}: launcher {s['launcher']}: {what}")
            out += [f"  - {n}" for n in s["notes"]]
    return out


def verdict_diff(paths: dict[str, dict[str, str | tuple[str, bool]]]) -> list[str]:
    """Cases whose answer differs between paths ({path: {case id: verdict, or (verdict, met its expectation)}}): one
    line each. With the expectation known, a case differs when it met its expectation on one path and not on another
    (a control's crash on one path and wrong output on the other is one answer: detected); evidence_diff lists those."""
    return _diff(paths, _answer)


def evidence_diff(paths: dict[str, dict[str, tuple[str, bool]]]) -> list[str]:
    """Cases with the same answer on every path but another verdict on one (a self control's crash and its wrong
    output: which evidence a stale capture leaves depends on what memory held)."""
    ids = {c for v in paths.values() for c in v}
    same = {c for c in ids if not _diff({n: {c: v.get(c)} for n, v in paths.items()}, _answer)}
    return _diff({n: {c: v for c, v in p.items() if c in same} for n, p in paths.items()}, lambda v: v[0])


def _answer(v) -> str:
    """What a case said on a path: its verdict (a record without its expectation), or met / cannot vouch (an error
    or skip: the harness could not run it) / not met."""
    if not isinstance(v, tuple):
        return v
    return "met" if v[1] else "cannot vouch" if v[0] in (ERROR, SKIP) else "not met"


def _diff(paths: dict, key) -> list[str]:
    names = list(paths)
    ids = sorted({c for v in paths.values() for c in v})
    out = []
    for c in ids:
        got = {n: paths[n].get(c) for n in names}
        if len({None if v is None else key(v) for v in got.values()}) > 1:
            out.append(f"{c}: " + ", ".join(f"{n} {_shown(v)}" for n, v in got.items()))
    return out


def _shown(v) -> str:
    if v is None:
        return "not run"
    return v if isinstance(v, str) else f"{v[0]} ({'as expected' if v[1] else 'NOT as expected'})"


PER_BUILD_GOAL_WARM_S, PER_BUILD_GOAL_COLD_S = 30.0, 60.0  # a build with its self control (docs/history.md)


def _caches(ph: dict | None) -> str:
    return (ph or {}).get("vllm_cache", "-")


def compare_markdown(runs: dict) -> str:
    """The paths side by side ({path: GateRun}, in the order run): outcome, wall, each build's wall against the goals
    (warm < 30 s, cold < 60 s per build), every case's phases and the verdict differences."""
    lines = ["## vLLM gate: old path against new path (one command)", ""]
    labels = sorted({lbl for r in runs.values() for lbl in r.build_wall_s})
    lines.append("| path | outcome | wall s | " + " | ".join(f"{b} s" for b in labels) + " |")
    lines.append("|---|---|---|" + "---|" * len(labels))
    for name, run in runs.items():
        walls = run.build_wall_s
        cells = " | ".join(_fmt(walls.get(b)) for b in labels)
        lines.append(f"| {name} | {run.judged().outcome} | {_fmt(run.wall_s)} | {cells} |")
    lines.append("")
    for name, run in runs.items():
        goal = PER_BUILD_GOAL_WARM_S if "warm" in name else PER_BUILD_GOAL_COLD_S if "cold" in name else None
        if goal is None:
            continue
        for b, w in sorted(run.build_wall_s.items()):
            met = "met" if w < goal else "NOT met"
            lines.append(f"- {name}: build {b} {w:.1f} s (goal < {goal:.0f} s): {met}")
    lines.append("")
    rows = []
    for name, run in runs.items():
        for c, r in [*run.references, *run.cases, *run.attributions]:
            rows.append((name, c.case_id, r.verdict, r.phases, _caches(r.phases)))
    lines += ["### How the case processes started", ""] + (launch_lines(runs) or ["- (no case ran)"]) + [""]
    lines += ["### Phases per case process (seconds)", ""] + phase_table(rows)
    diff = verdict_diff(path_verdicts(runs))
    lines += ["", f"### Verdict differences between the paths: {len(diff)}", ""]
    lines += [f"- {d}" for d in diff] or ["none: every case has the same answer on every path"]
    other = evidence_diff(path_verdicts(runs))
    if other:
        lines += ["", f"Same answer, other evidence: {len(other)}", ""] + [f"- {d}" for d in other]
    return "\n".join(lines) + "\n"


def path_verdicts(runs: dict) -> dict[str, dict[str, tuple[str, bool]]]:
    """{path: {case id: (verdict, met its expectation)}} over the cases and the attribution reruns (references aside:
    a kept one is the same record)."""
    return {
        n: {c.case_id: (r.verdict, passes(c, r)) for c, r in [*run.cases, *run.attributions]} for n, run in runs.items()
    }


def compare_json(runs: dict) -> dict:
    return {
        name: {
            "outcome": run.judged().outcome,  # the answer its command decided (GateRun.judge), not a default
            "wall_s": run.wall_s,
            "build_wall_s": run.build_wall_s,
            "launches": run.launches,
            "cases": {
                c.case_id: {"verdict": r.verdict, "phases": r.phases}
                for c, r in [*run.references, *run.cases, *run.attributions]
            },
        }
        for name, run in runs.items()
    }
