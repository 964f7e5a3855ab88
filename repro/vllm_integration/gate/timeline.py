"""A gate run's whole timeline from its record (`records --speed NAME --timeline`): every process (case, attempt,
launch-blocking rerun, reference, and a rerun started beside a control and dropped) with its start, end and phases
against the run's wall clock; the concurrency over time; the worker slots' idle seconds; the critical path (the slot
whose chain of processes ended last); the retries' and references' seconds; the forkserver's start and what the run
did after its last process (judging, reports).

Where the times come from: results.json's rows (each process's `started_at` and wall, its phases as the run computed
them; a reference kept from an earlier run ran no process and is left out); a dropped rerun has no row, only its logs: its RESULT record's main_at/done_at. The run's own start is the
first process's start less the forkserver's ready time (no process forks before it is ready); a record from a spawn
run has no forkserver: its start is the first process's."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from repro.contract.channel import Channel
from repro.contract.tags import RESULT_TAG
from repro.contract.verdicts import CLEAN, WRONG
from repro.vllm_integration.gate.cache import KEPT_LINE, forkserver_ready

BESIDE = "launch-blocking"  # a rerun's suffix (process.run_attributed)
_ATTEMPT = re.compile(r"-attempt\d+$")
_WORKERS = re.compile(r"cases at a time: (\d+)")
_CPUS = re.compile(r"(?:of (\d+) CPU cores|one a CPU core \((\d+)\))")
_MEMORY = re.compile(r"GPU memory (\d+) of (\d+) GiB free")
COLD_JIT_S = 5.0  # a process whose Triton warmup took longer compiled its kernels (an empty Triton cache)


@dataclass(frozen=True)
class Proc:
    """One process of the run: its case id, what it was, when (seconds from the run's start) and its phases."""

    case: str
    kind: str  # case, reference, attempt, attribution, beside (a rerun started beside a control, then dropped)
    start: float
    end: float
    phases: dict = field(default_factory=dict)

    @property
    def wall(self) -> float:
        return self.end - self.start

    @property
    def chain(self) -> str:
        """The case whose worker slot it held: an attempt's and a rerun's case."""
        return _ATTEMPT.sub("", self.case.removesuffix(f"-{BESIDE}"))


@dataclass
class Timeline:
    procs: list[Proc]
    wall_s: float  # the run's wall (results.json), from its start
    ready_s: float | None  # the forkserver ready after the run's start (None: spawned)
    workers: int  # cases at a time (the run's terminal line, else the most chains at once)
    unread: list[str] = field(default_factory=list)  # dropped reruns whose logs hold no time
    # case id -> True where its further attempts ran although its first was already wrong against its reference
    # (judged so at the end): a reference finished before that attempt ended would have stopped them
    early: dict[str, bool] = field(default_factory=dict)
    cpus: int | None = None  # the machine's CPU cores and the GPU's (free, total) GiB, as its terminal line said
    memory: tuple[float, float] | None = None


def load(folder: Path) -> Timeline:
    """The timeline of an unpacked gate record folder (results.json, logs/, terminal.log)."""
    doc = json.loads((folder / "results.json").read_text())
    rows = [
        r
        for r in doc.get("cases", []) + doc.get("references", [])
        if (r.get("result") or {}).get("started_at") and not _kept(folder / "logs" / f"{r['case']}.out.log")
    ]
    ready = forkserver_ready(doc.get("launches"))
    if not rows:
        raise ValueError("no process in this record kept its start (results.json rows without started_at)")
    t0 = min(r["result"]["started_at"] for r in rows) - (ready or 0.0)
    procs = [
        Proc(r["case"], r.get("kind", "case"), r["result"]["started_at"] - t0,
             r["result"]["started_at"] - t0 + r["wall_s"], r["result"].get("phases") or {})
        for r in rows
    ]  # fmt: skip
    seen = {p.case for p in procs}
    unread = []
    for log in sorted((folder / "logs").glob(f"*-{BESIDE}.channel.jsonl")):
        case = log.name.removesuffix(".channel.jsonl")
        if case in seen:
            continue
        res = Channel.read(log).last(RESULT_TAG) if log.exists() else None
        t = (res or {}).get("timing_s") or {}
        if not t.get("main_at") or not t.get("done_at"):
            unread.append(case)
            continue
        procs.append(Proc(case, "beside", t["main_at"] - t0, t["done_at"] - t0, {"teardown": None}))
    term = folder / "terminal.log"
    said = term.read_text(errors="replace") if term.exists() else ""
    m = _WORKERS.search(said)
    tl = Timeline(sorted(procs, key=lambda p: (p.start, p.case)), float(doc.get("wall_s") or 0.0), ready, 0, unread)
    tl.workers = int(m[1]) if m else max_at_once(chains(tl.procs))
    if c := _CPUS.search(said):
        tl.cpus = int(c[1] or c[2])
    if g := _MEMORY.search(said):
        tl.memory = (float(g[1]), float(g[2]))
    tl.early = {
        r["case"]: r.get("verdict") == WRONG.value and (r["attempts"][0] or {}).get("verdict") == CLEAN.value
        for r in doc.get("cases", [])
        if len(r.get("attempts") or ()) > 1
    }
    return tl


def _kept(log: Path) -> bool:
    """A reference kept from an earlier run: no process of this run (its row's start is the earlier run's)."""
    try:
        with log.open(errors="replace") as f:
            return f.read(len(KEPT_LINE)) == KEPT_LINE
    except OSError:
        return False


def chains(procs: list[Proc]) -> dict[str, tuple[float, float]]:
    """Each case's worker slot held: from its first process's start to its last's end (attempts and reruns)."""
    out: dict[str, tuple[float, float]] = {}
    for p in procs:
        s, e = out.get(p.chain, (p.start, p.end))
        out[p.chain] = (min(s, p.start), max(e, p.end))
    return out


def concurrency(spans) -> list[tuple[float, float, int]]:
    """(from, to, how many at once) over the spans' union, in time order."""
    edges = sorted({t for s, e in spans for t in (s, e)})
    return [(a, b, sum(1 for s, e in spans if s <= a and e >= b)) for a, b in zip(edges, edges[1:]) if b > a]


def max_at_once(ch: dict[str, tuple[float, float]]) -> int:
    return max((n for _, _, n in concurrency(ch.values())), default=1)


def slots(ch: dict[str, tuple[float, float]], workers: int) -> list[list[str]]:
    """The chains as the worker slots ran them: each chain on the slot that freed last before it started."""
    lanes: list[list[str]] = []
    for case, (s, _e) in sorted(ch.items(), key=lambda kv: kv[1]):
        free = [ln for ln in lanes if ch[ln[-1]][1] <= s + 0.5]
        if free:
            max(free, key=lambda ln: ch[ln[-1]][1]).append(case)
        else:
            lanes.append([case])
    return lanes


def profile(tl: Timeline) -> dict:
    """The numbers of the whole run (seconds from its start)."""
    procs = tl.procs
    ch = chains(procs)
    first = min(p.start for p in procs)
    last = max(p.end for p in procs)
    levels = concurrency([(p.start, p.end) for p in procs])
    by_level: dict[int, float] = {}
    for a, b, n in levels:
        by_level[n] = round(by_level.get(n, 0.0) + b - a, 1)
    busy = sum(e - s for s, e in ch.values())
    lanes = slots(ch, tl.workers)
    crit = max(lanes, key=lambda ln: ch[ln[-1]][1])
    queue_empty = max(s for s, _ in ch.values())
    tail = [(a, b, n) for a, b, n in concurrency(ch.values()) if a >= queue_empty]
    kinds: dict[str, list[float]] = {}
    for p in procs:
        kinds.setdefault(p.kind, []).append(p.wall)
    cold = [p for p in procs if (p.phases.get("jit") or 0) > COLD_JIT_S]
    teardown = [p.phases["teardown"] for p in procs if isinstance(p.phases.get("teardown"), (int, float))]
    return {
        "wall": tl.wall_s,
        "forkserver_ready": tl.ready_s,
        "first_start": round(first, 1),
        "last_end": round(last, 1),
        "after_last": round(tl.wall_s - last, 1),
        "processes": len(procs),
        "workers": tl.workers,
        "process_seconds": round(sum(p.wall for p in procs), 1),
        "slot_seconds": round(busy, 1),
        "idle_slot_seconds": round(tl.workers * (last - first) - busy, 1),
        "mean_at_once": round(sum(p.wall for p in procs) / max(1e-9, last - first), 1),
        "seconds_at_once": dict(sorted(by_level.items())),
        "queue_empty_at": round(queue_empty, 1),
        "tail_idle_slot_seconds": round(sum((tl.workers - n) * (b - a) for a, b, n in tail), 1),
        "by_kind": {k: (len(v), round(sum(v), 1)) for k, v in sorted(kinds.items())},
        "cold_jit": (len(cold), round(sum(p.phases["jit"] for p in cold), 1)),
        "teardown": round(sum(teardown), 1),
        "critical_path": [(c, round(ch[c][0], 1), round(ch[c][1], 1)) for c in crit],
        "unread": tl.unread,
    }


def _short(case: str) -> str:
    return case.split("-", 3)[-1] if case.startswith("stale_metadata-vllm-") else case


def markdown(name: str, tl: Timeline) -> str:
    """The profile and every process's line, for `records --speed --timeline`."""
    p = profile(tl)
    n_ref, ref_s = p["by_kind"].get("reference", (0, 0.0))
    lines = [
        f"## {name}: the whole run's timeline (seconds from the run's start)",
        "",
        f"- wall {p['wall']:.1f} s; forkserver ready at {_f(p['forkserver_ready'])} s; first process at "
        f"{p['first_start']:.1f} s; last process ended at {p['last_end']:.1f} s; after it (judging, reports) "
        f"{p['after_last']:.1f} s",
        f"- {p['processes']} processes, {p['process_seconds']:.1f} process-seconds; {p['workers']} worker slots held "
        f"{p['slot_seconds']:.1f} s, idle {p['idle_slot_seconds']:.1f} slot-seconds between the first start and the "
        f"last end; {p['mean_at_once']:.1f} processes at once on average",
        "- seconds with N processes at once: " + ", ".join(f"{n}: {s:.1f}" for n, s in p["seconds_at_once"].items()),
        f"- the queue emptied at {p['queue_empty_at']:.1f} s (the last case's first process started); after it "
        f"{p['tail_idle_slot_seconds']:.1f} slot-seconds idle while the last chains finished",
        "- processes by kind (count, seconds): "
        + ", ".join(f"{k} {n} / {s:.1f}" for k, (n, s) in p["by_kind"].items()),
        f"- references: {n_ref}, {ref_s:.1f} s; cold Triton warmup (jit > {COLD_JIT_S:g} s): {p['cold_jit'][0]} "
        f"processes, {p['cold_jit'][1]:.1f} s; teardown {p['teardown']:.1f} s in all",
        "- critical path (the slot that ended last): "
        + " -> ".join(f"{_short(c)} [{s:.1f}-{e:.1f}]" for c, s, e in p["critical_path"]),
    ]
    if p["unread"]:
        lines.append(f"- dropped reruns without a time in their logs: {', '.join(map(_short, p['unread']))}")
    cols = ("cuda", "compile", "jit", "capture", "engine_rest", "decode", "teardown")
    lines += ["", "| process | kind | start | end | wall | " + " | ".join(cols) + " | cache |",
              "|---|---|---|---|---|" + "---|" * (len(cols) + 1)]  # fmt: skip
    for q in tl.procs:
        cells = " | ".join(_f(q.phases.get(k)) for k in cols)
        lines.append(
            f"| {_short(q.case)} | {q.kind} | {q.start:.1f} | {q.end:.1f} | {q.wall:.1f} | {cells} | "
            f"{q.phases.get('vllm_cache', '-')} |"
        )
    return "\n".join(lines) + "\n"


def _f(v) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "-"
