"""Benchmark numbers from recorded matrix runs: throughput, time to the first positive control, and the
compute-sanitizer overhead per case (the same case ids with and without memcheck)."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from repro.case.spec import RERUN_ALONE
from repro.errors import ConfigError
from repro.report.results import load_json
from repro.run import server
from repro.run.matrix import MatrixRun, run_matrix
from repro.run.runner import make_executor

PHASES = ("start_s", "import_s", "cuda_init_s", "work_s", "teardown_s")


def summarize(run: MatrixRun) -> dict:
    walls = [r.wall_s for _, r in run.results]
    phased = [r.phases for _, r in run.results if r.phases and all(k in r.phases for k in PHASES)]
    return {
        "phases_mean_s": {k: round(statistics.mean(p[k] for p in phased), 3) for k in PHASES} if phased else None,
        "cases": len(walls),
        "wall_s": run.wall_s,
        "cases_per_min": round(60 * len(walls) / run.wall_s, 1) if run.wall_s else None,
        "mean_case_s": round(statistics.mean(walls), 2) if walls else None,
        "max_case_s": max(walls) if walls else None,
        "first_positive_s": run.first_positive_s,
    }


def sanitizer_overhead(plain: MatrixRun, sanitized: MatrixRun) -> dict:
    """Per-case wall time under memcheck against the same case without it (matched by case id)."""
    base = {s.case_id: r.wall_s for s, r in plain.results}
    pairs = [
        (base[s.case_id.replace("-memcheck", "")], r.wall_s)
        for s, r in sanitized.results
        if s.case_id.replace("-memcheck", "") in base
    ]
    if not pairs:
        return {"matched": 0}
    return {
        "matched": len(pairs),
        "plain_mean_s": round(statistics.mean(p for p, _ in pairs), 2),
        "memcheck_mean_s": round(statistics.mean(m for _, m in pairs), 2),
        "overhead_mean_s": round(statistics.mean(m - p for p, m in pairs), 2),
        "ratio_median": round(statistics.median(m / p for p, m in pairs if p > 0), 2),
    }


def recorded_gpu_run(path: str | Path) -> MatrixRun:
    """A recorded results.json that holds GPU cases, or ConfigError saying what it holds instead."""

    run = load_json(path)
    if not run.results:
        raise ConfigError(f"{path}: holds no cases")
    if run.source != "gpu":
        raise ConfigError(f"{path}: holds CPU-model predictions; the benchmark needs GPU runs")
    return run


def benchmark_markdown(plain_path: str | Path, sanitized_path: str | Path) -> str:

    plain, san = recorded_gpu_run(plain_path), recorded_gpu_run(sanitized_path)
    for path, run, memcheck in ((plain_path, plain, False), (sanitized_path, san, True)):  # each is what it is called
        if wrong := [sp.case_id for sp, _ in run.results if bool(sp.sanitizer) != memcheck]:
            ran = "ran under compute-sanitizer" if not memcheck else "did not run under compute-sanitizer"
            raise ConfigError(
                f"{path}: {len(wrong)} of its {len(run.results)} cases {ran} ({wrong[0]}): not the "
                f"{'memcheck' if memcheck else 'plain'} run (give PLAIN MEMCHECK: matrix without and with "
                "--sanitizer)"
            )
    a, b, o = summarize(plain), summarize(san), sanitizer_overhead(plain, san)
    lines = [
        "# Benchmark: the default matrix",
        "",
        f"Plain: `{plain_path}`; memcheck: `{sanitized_path}`.",
        "",
        "| run | cases | wall s | cases/min | mean case s | max case s | first positive s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in (("plain", a), ("memcheck", b)):
        lines.append(
            f"| {name} | {s['cases']} | {s['wall_s']} | {s['cases_per_min']} | {s['mean_case_s']} | "
            f"{s['max_case_s']} | {s['first_positive_s']} |"
        )
    lines += [
        "",
        f"Sanitizer overhead per case ({o.get('matched')} matched cases): "
        f"{o.get('plain_mean_s')} s -> {o.get('memcheck_mean_s')} s mean, "
        f"+{o.get('overhead_mean_s')} s, median ratio {o.get('ratio_median')}x.",
        "",
    ]
    return "\n".join(lines)


# The execution paths the benchmark puts side by side: (executor, MPS daemon policy).
PATHS = {
    "old": ("process", "per-case"),  # a fresh interpreter per case, an MPS daemon per MPS case
    "new": ("forkserver", "shared"),  # cases forked from a pre-imported server, one MPS daemon, clean cases batched
    "served": ("server", "shared"),  # as new, from a repro server already running (`repro serve`, repro.run.server)
}


def compare_executors(specs, out_dir: str | Path, jobs: int, progress=None) -> tuple[str, dict[str, MatrixRun]]:
    """The same matrix run on every path (PATHS) in one command: wall, throughput, time to the first positive
    control, the per-case split by phase, and the verdict diffs (must be empty). The served path gets a repro server
    of its own (a private socket), started before its clock starts, as `repro serve` is once for many commands; how
    long that took is said apart. Returns (Markdown, runs by path); each path's logs go to out_dir/<path>/logs."""

    specs = list(specs)
    runs: dict[str, MatrixRun] = {}
    notes = []
    for name, (executor, mps_daemon) in PATHS.items():
        sock = None
        if executor == "server":
            sock = Path(tempfile.mkdtemp(prefix="repro-bench-")) / "server.sock"
            t0 = time.time()
            ex = server.ServerExecutor(sock, server.start(sock, idle_s=600), spares=jobs)
            notes.append(f"The {name} path's server took {time.time() - t0:.1f} s to start (before that path's clock).")
        else:
            ex = make_executor(executor, jobs)
        try:
            runs[name] = run_matrix(
                specs, Path(out_dir) / name / "logs", jobs=jobs, progress=progress, executor=ex, mps_daemon=mps_daemon
            )
            if getattr(ex, "notes", None):  # a case its forkserver could not start: the path's figures count it fresh
                notes.append(f"The {name} path started some cases fresh instead of forked: {'; '.join(ex.notes)}.")
        finally:
            if sock is not None:
                server.stop(sock)
                shutil.rmtree(sock.parent, ignore_errors=True)
    return paths_markdown(runs) + "".join(f"\n{n}\n" for n in notes), runs


def paths_markdown(runs: dict[str, MatrixRun]) -> str:
    """The side-by-side table of execution paths' runs of one matrix ("old", "new" and any more of PATHS): wall,
    throughput, per-phase split, the first positive control and its phases, MPS reruns, and the verdict diffs."""
    sums = {n: summarize(r) for n, r in runs.items()}
    va = {s.case_id: r.verdict for s, r in runs["old"].results}
    vb = {s.case_id: r.verdict for s, r in runs["new"].results}
    diff = sorted(f"{k}: {va[k]} -> {vb.get(k)}" for k in va if va[k] != vb.get(k))
    reruns = [s.case_id for s, r in runs["new"].results if RERUN_ALONE in r.flags]
    lines = [
        "## Case execution paths, side by side on one matrix",
        "",
        "| path | executor | MPS daemon | cases | wall s | cases/min | mean case s | max case s | first positive s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, s in sums.items():
        executor, mps_daemon = PATHS.get(name, ("-", "-"))
        lines.append(
            f"| {name} | {executor} | {mps_daemon} | {s['cases']} | {s['wall_s']} | {s['cases_per_min']} | "
            f"{s['mean_case_s']} | {s['max_case_s']} | {s['first_positive_s']} |"
        )
    lines += ["", "Mean seconds per case process, by phase (cases that reached CUDA):", ""]
    lines += ["| path | " + " | ".join(PHASES) + " |", "|---|" + "---|" * len(PHASES)]
    for name, s in sums.items():
        ph = s["phases_mean_s"] or {}
        lines.append(f"| {name} | " + " | ".join(str(ph.get(k, "-")) for k in PHASES) + " |")
    lines += ["", "The first positive control on each path, and where its process's time went:", ""]
    for name, run in runs.items():
        first = next((r for s, r in run.results if s.case_id == run.first_positive_case), None)
        ph = ", ".join(f"{k} {v}" for k, v in (first.phases or {}).items()) if first else "-"
        lines.append(f"- {name}: {run.first_positive_case or 'none'} after {run.first_positive_s} s ({ph})")
    lines += ["", f"MPS cases rerun alone on the new path: {len(reruns)}"]
    lines += [f"- {c}" for c in reruns]
    lines += ["", f"Verdict diff: {len(diff)} case(s)" + (":" if diff else " (the paths agree)")]
    lines += [f"- {d}" for d in diff]
    for name in (n for n in runs if n not in ("old", "new")):  # further paths: against the old one
        vc = {s.case_id: r.verdict for s, r in runs[name].results}
        more = sorted(f"{k}: {va[k]} -> {vc.get(k)}" for k in va if va[k] != vc.get(k))
        again = [s.case_id for s, r in runs[name].results if RERUN_ALONE in r.flags]
        lines += ["", f"MPS cases rerun alone on the {name} path: {len(again)}"] + [f"- {c}" for c in again]
        lines += ["", f"Verdict diff, old -> {name}: {len(more)} case(s)" + (":" if more else " (the paths agree)")]
        lines += [f"- {d}" for d in more]
    return "\n".join(lines) + "\n"


def paths_from_files(old: str | Path, new: str | Path) -> str:
    """paths_markdown for two recorded results.json of the same matrix: the old path's, then the new path's."""

    runs = {"old": recorded_gpu_run(old), "new": recorded_gpu_run(new)}
    if os.path.realpath(old) == os.path.realpath(new):  # one record twice: "the paths" would be one run, labelled two
        raise ConfigError(f"--paths {old} {new}: one record twice: give the old path's run, then the new path's")
    if sorted(s.case_id for s, _ in runs["old"].results) != sorted(s.case_id for s, _ in runs["new"].results):
        raise ConfigError(f"{old} and {new} hold different matrices: the paths must run the same cases")
    return paths_markdown(runs)
