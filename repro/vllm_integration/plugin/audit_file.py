"""The audit file every audited process of a run merges its report into (REPRO_AUDIT_FILE, or a gate case's): the
merge under a lock, whole or not at all (merge_into), and the one report its readers read (merged_report).
repro.vllm_integration.plugin.counters writes through it; `repro audit` and the pytest plugin read what it made."""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any

from repro.files import write_whole


def is_final(report: dict) -> bool:
    """Is a process's report its exit report? A report without `final` was written before snapshots were: at exit."""
    return report.get("final", True) is not False


def merge_into(path: str, reports: list[tuple[dict, list[dict]]]) -> None:
    """Each (process report, its mismatches) merged into the audit file at path (merged_report), under a lock on
    the audit file's folder itself (flock on the folder: no file made anywhere; where this process cannot open or
    flock the folder (NFS, Lustre), a lock file in the temporary folder named by the audit file's real path), the
    file written whole (repro.files.write_whole: a temporary beside it, renamed into place; a link written
    through to its file): a reader, or a process killed in the middle of its write, never sees half a file; a path
    that is not a regular file is refused (ConfigError). A process's own exit report or snapshot, or those `pytest
    --repro-audit` forwards to the `repro audit` around it."""
    real = os.path.realpath(path)
    lock = _locked(real)
    try:
        try:
            with open(real) as f:
                doc = json.loads(f.read())
        except (FileNotFoundError, ValueError):  # none yet, or not a report: nothing of this run's
            doc = None
        for mine, mismatches in reports:
            doc = merged_report(doc, mine, mismatches)
        # not fsynced: the file must outlive its writer's SIGKILL (the page cache keeps it), not the machine's loss,
        # and a clean process writes a snapshot at every FULL capture
        write_whole(real, json.dumps(doc, indent=1), durable=False)
    finally:
        os.close(lock)  # the flock goes with it


def merged_report(earlier: Any, mine: dict, mismatches: list[dict]) -> dict:
    """The audit file once this process (`mine`, with its `mismatches`) reported into it: the reports of this run's
    other processes kept (those with its token, `run`: started by the same first process, before or after this one
    installed its auditor; an earlier run's, or a file of another shape, is replaced), then the totals every reader
    reads as one report: `checks`, `views`, `descriptor_checks` summed, `mismatches` every process's in the order of
    `processes` (each process's count of them its `stale`), `summary` naming each process and what it checked. A
    process that checked nothing is listed, never in place of one that did."""
    kept: list[tuple[dict, list]] = []
    final: tuple[dict, list] | None = None  # this process's exit report already there: a snapshot never replaces it
    if isinstance(earlier, dict) and isinstance(earlier.get("processes"), list):
        at = 0
        for p in earlier["processes"]:
            n = p.get("stale") if isinstance(p, dict) else 0
            n = n if isinstance(n, int) and n > 0 else 0  # a malformed entry counts no mismatches
            if isinstance(p, dict) and p.get("run") == mine["run"]:
                own = list(earlier.get("mismatches") or [])[at : at + n]
                if p.get("pid") != mine["pid"]:
                    kept.append((_kept(p, mine), own))
                elif is_final(p) and not is_final(mine):
                    final = (p, own)
            at += n
    kept.append(final or (mine, mismatches))
    processes = [p for p, _ in kept]
    checked = [p for p in processes if p["checks"]]
    said = "; ".join(f"{p['process']} (pid {p['pid']}): {p['summary']}" for p in processes)
    return {
        "checks": sum(p["checks"] for p in processes),
        "views": sum(p["views"] for p in processes),
        "descriptor_checks": sum(p["descriptor_checks"] for p in processes),
        "mismatches": [m for _, ms in kept for m in ms],
        "summary": f"{len(processes)} process(es) reported, {len(checked)} with checks: {said}",
        "processes": processes,
    }


def _kept(p: dict, mine: dict) -> dict:
    """An earlier report of the run in the shape of `mine` (a key it lacks: 0), final or a snapshot as it was."""
    out = {k: p.get(k, 0) for k in mine if k not in ("final", "snapshot_reason")}
    out["final"] = is_final(p)
    if not out["final"]:
        out["snapshot_reason"] = p.get("snapshot_reason") or "an event not named"
    return out


def _locked(real: str) -> int:
    """A descriptor holding the audit file's lock (merge_into): a flock on its folder, else on a lock file in the
    temporary folder named by the file's real path."""
    import fcntl  # noqa: PLC0415  one lock per audit file, only where there is one (Linux, as vLLM)
    import hashlib  # noqa: PLC0415  the lock's name, only where there is an audit file
    import tempfile  # noqa: PLC0415  the lock's folder, likewise

    with contextlib.suppress(OSError):  # NFS and Lustre may refuse a flock on a folder: then the lock file
        lock = os.open(os.path.dirname(real) or ".", os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            return lock
        except OSError:
            os.close(lock)
            raise
    key = hashlib.sha1(real.encode()).hexdigest()[:20]
    lock = os.open(os.path.join(tempfile.gettempdir(), f"repro-audit-{key}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    except BaseException:  # no lock (ENOLCK, Ctrl-C): the descriptor goes too (snapshots come every 2 s)
        os.close(lock)
        raise
    return lock
