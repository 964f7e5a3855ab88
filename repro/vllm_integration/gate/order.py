"""The order the gate's scheduler starts its cases in, and a simulation of a run from a record's timeline that says
what an order and a number of slots would have made of its wall.

The order (GateScheduler.collect): references first, on REF_SLOTS slots of their own beside the cases (a reference runs
eager, no compile and no capture: seconds, cold or warm; a self control's clean attempt is judged against its
finished reference at once, and no further attempt runs: gate.process.run_control), then the cases longest first
(the longest-processing-time rule: the longest chains must not be the last to start, leaving the other slots
idle while they finish). A case's cost is what it took in this GPU's last run from the same cache folder
(GateCache.costs), else the static model (static_cost): a self control that may run again (gate.process.retried)
counts every attempt, an audit-mode case more than a plain one."""

from __future__ import annotations

import heapq
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from repro.run.memory import GIB, MemoryBudget
from repro.vllm_integration.gate.placement import FREE_AT_START, GIB_PER_CASE, cold_jobs, fit_jobs
from repro.vllm_integration.gate.timeline import COLD_JIT_S, Timeline, chains

T = TypeVar("T")

ATTEMPT_S, AUDIT_EXTRA_S = 15.0, 4.0  # a warm case's process, and what the auditor adds (the static model)
# What a reference adds started on empty caches: it compiles no graph and runs no JIT warmup (enforce_eager), so only
# CUDA's start and the Triton kernels eager mode launches; an assumption until a run starts its references cold
REF_COLD_S = 10.0
REF_SLOTS = 2  # references at once beside the cases (the scheduler's and the simulation's)


def static_cost(reference: bool, retried: bool, audit: bool, attempts: int) -> float:
    """A case's estimated slot seconds where no run measured it: references cheapest, a self control that may run
    again its every attempt, an audit case more than a plain one."""
    if reference:
        return ATTEMPT_S / 2
    return ATTEMPT_S * (attempts if retried else 1) + (AUDIT_EXTRA_S if audit else 0.0)


def longest_first(items: Iterable[T], cost: Callable[[T], float]) -> list[T]:
    """The items by cost, highest first; equal costs keep their order (the plan's)."""
    return sorted(items, key=lambda i: -cost(i))


@dataclass(frozen=True)
class Job:
    """One chain of a simulated run: a case (or reference) and its processes' seconds in its slot, warm."""

    case: str
    attempts: tuple[float, ...]  # each attempt's slot seconds (the longer of it and a rerun beside it), warm
    reference: str | None = None  # its reference's case id (a case); None: it is a reference
    early_stop: bool = False  # its later attempts only ran because its reference had not finished
    cold_s: float = 0.0  # what it adds when it starts before the build's caches are warm
    gib: float = 4.0  # the GPU memory it holds (placement.case_gib; twice that with a rerun beside it)
    processes: int = 1  # its processes at once (2: a plain control's launch-blocking rerun beside it)

    @property
    def cost(self) -> float:
        return sum(self.attempts)


@dataclass(frozen=True)
class Simulated:
    wall: float  # from the run's start: forkserver ready, the processes, what followed the last
    last_end: float
    starts: dict  # case id -> its chain's start


def simulate(
    jobs: Sequence[Job],
    workers: int,
    ready_s: float,
    after_s: float = 0.0,
    ref_slots: int = 0,
    cold: bool = True,
    cold_workers: int | None = None,
    budget_gib: float | None = None,
    per_process: bool = False,
) -> Simulated:
    """List scheduling of the jobs in their order: `workers` slots for the cases (and the references when
    ref_slots is 0), `ref_slots` more for the references only. A case process that starts before the first cold case
    process ends (cold: the build's Triton and compile caches are empty until then) takes its cold_s more, and at
    most `cold_workers` of them run at once (None: `workers`); a later one waits for the caches. A job with early_stop
    runs one attempt when its reference ended before its first attempt did. `budget_gib`: the GPU memory the jobs
    hold together (each its `gib` over its chain, as run.MemoryBudget holds it); a job that does not fit waits.
    `per_process`: the fitted scheduler's limits (placement.ProcessSlots, ColdSlots): `workers` and `cold_workers`
    count processes, a job holds its `processes` of each (never more than the limit), and a reference on its own
    slots holds one of `workers` too; else they count jobs (an explicit --jobs, and the runs before)."""
    inf = float("inf")
    ref_done: dict[str, float] = {}
    starts: dict[str, float] = {}
    state = {"warm_at": inf if cold else ready_s}
    cold_ends: list[tuple[float, int]] = []  # the cold case processes' ends, and the slots each held
    held: list[tuple[float, float, float, int]] = []  # (start, end, GiB, processes) of every chain placed
    lanes = {"case": [(ready_s, i) for i in range(max(1, workers))]}
    lanes["ref"] = [(ready_s, i) for i in range(ref_slots)] if ref_slots else lanes["case"]
    for pool in lanes.values():
        heapq.heapify(pool)
    queue = {"ref": [j for j in jobs if j.reference is None], "case": [j for j in jobs if j.reference is not None]}
    if not ref_slots:  # one queue, the jobs' own order
        queue = {"case": list(jobs), "ref": []}

    def chain(j: Job, t: float) -> tuple[float, list[float]]:
        """Its end started at t, and the ends of its attempts that ran cold."""
        end = first_end = t
        colds: list[float] = []
        for k, d in enumerate(j.attempts):
            if k and j.early_stop and ref_done.get(j.reference or "", inf) <= first_end:
                break
            extra = j.cold_s if end < min([state["warm_at"], *colds]) else 0.0  # its own cold attempt warms them
            end += d + extra
            if extra and j.reference is not None:
                colds.append(end)
            if k == 0:
                first_end = end
        return end, colds

    def peak(t0: float, t1: float, of: int) -> float:
        """The most GiB (of=2) or processes (of=3) the placed chains hold at once within [t0, t1)."""
        points = [t0] + [h[0] for h in held if t0 < h[0] < t1]
        return max(sum(h[of] for h in held if h[0] <= p < h[1]) for p in points)

    def blocked(j: Job, t: float, procs: int) -> bool:
        """Must the job wait at t: a cold slot, the GPU memory or a process slot not free over its chain."""
        end = chain(j, t)[0]
        if j.reference is not None and t < state["warm_at"] and cold_workers:
            if sum(n for e, n in cold_ends if e > t) + min(procs, cold_workers) > cold_workers:
                return True
        if budget_gib and peak(t, end, 2) + min(j.gib, budget_gib) > budget_gib:
            return True
        return per_process and peak(t, end, 3) + min(procs, workers) > workers

    events = []
    for kind in ("ref", "case"):
        pool = lanes[kind]
        for j in queue[kind]:
            t, slot = heapq.heappop(pool)
            procs = j.processes if per_process else 1
            while blocked(j, t, procs):  # wait for the next chain, cold process or the warm caches to end
                later = [h[1] for h in held if h[1] > t] + [e for e, _n in cold_ends if e > t]
                later += [state["warm_at"]] if t < state["warm_at"] < inf else []
                if not later:
                    break
                t = min(later)
            starts[j.case] = t
            end, colds = chain(j, t)
            cold_ends += [(e, procs) for e in colds]
            state["warm_at"] = min([state["warm_at"], *colds])  # the first cold case filled the caches (simplified)
            held.append((t, end, j.gib, procs))
            if j.reference is None:
                ref_done[j.case] = end
            events.append(end)
            heapq.heappush(pool, (end, slot))
    last = max(events, default=ready_s)
    return Simulated(round(last + after_s, 1), round(last, 1), starts)


def jobs_from_timeline(tl: Timeline, warm_run: bool = False, now: bool = False) -> tuple[list[Job], float]:
    """(the record's chains as Jobs in the order they started, the cold seconds a process added) from a
    gate.timeline.Timeline. A chain's warm seconds are its recorded ones less the cold seconds where its process
    compiled Triton's kernels; `warm_run`: as a warm run would take them (compile loaded from the build's cache,
    references kept: no process). `now`: as this scheduler would start them: a self control's launch-blocking rerun
    (started beside it in records before GateCase.name_kernel) left out, a known-bad build's plain case's kept."""
    procs = tl.procs

    def startup(p) -> float:
        return sum(p.phases.get(k) or 0.0 for k in ("jit", "cuda", "compile"))

    cold = [p for p in procs if (p.phases.get("jit") or 0) > COLD_JIT_S]
    warm = [p for p in procs if 0 < (p.phases.get("jit") or 0) <= COLD_JIT_S]
    cold_s = statistics.median(map(startup, cold)) - statistics.median(map(startup, warm)) if cold and warm else 0.0
    loaded = min((p.phases["compile"] for p in warm if p.phases.get("compile")), default=0.0)
    # a run that started a rerun beside each plain self control (a dropped one may have left no time in its logs)
    controls_rerun = any("-self-control" in p.case and p.case.endswith("-launch-blocking") for p in procs)
    jobs = []
    for case, _span in sorted(chains(procs).items(), key=lambda kv: kv[1]):
        control = "-self-control" in case
        mine = [p for p in procs if p.chain == case and not (now and control and p.case.endswith("-launch-blocking"))]
        tries: dict[str, list] = {}
        for p in mine:
            tries.setdefault(p.case.removesuffix("-launch-blocking"), []).append(p)
        secs = []
        for ps in tries.values():
            d = max(p.wall for p in ps)
            lead = min(ps, key=lambda p: p.kind in ("attribution", "beside"))  # the attempt itself
            if (lead.phases.get("jit") or 0) > COLD_JIT_S:
                d -= cold_s
            if warm_run:
                d -= max(0.0, (lead.phases.get("compile") or 0.0) - loaded)
            secs.append(max(0.5, d))
        is_ref = all(p.kind == "reference" for p in mine)
        if is_ref and warm_run:
            continue  # kept: no process
        ref = None if is_ref else _reference_of(case)
        extra = REF_COLD_S if is_ref else cold_s
        # process.attributed_beside: a rerun beside it (now a known-bad build's plain case; in a record, one that
        # started with its attempt, a self control's before GateCase.name_kernel)
        reruns = [p.start for p in mine if p.case.endswith("-launch-blocking")]
        starts = [p.start for p in mine if not p.case.endswith("-launch-blocking")]
        with_it = any(abs(r - s) < 1.0 for r in reruns for s in starts) or control and controls_rerun
        beside = case.endswith("-plain") and (not control and "-under-test" not in case if now else with_it)
        n = 2 if beside else 1
        early = tl.early.get(case, False)
        jobs.append(Job(case, tuple(secs), ref, early_stop=early, cold_s=extra, gib=GIB_PER_CASE * n, processes=n))
    return jobs, cold_s


def _reference_of(case: str) -> str:
    """A gate case id's reference's id (gate.case.reference_for's naming: the build under test's, in its SM)."""
    head, _, rest = case.partition("-self-control")
    if rest:
        rest = rest.removeprefix("-stale-descriptor")
        head = f"{head}-under-test"
    else:
        head, _, rest = case.partition("-under-test")
        head += "-under-test"
    method, _, mode = rest.lstrip("-").rpartition("-")
    return f"{head}{'-' + method if method else ''}-reference-sm-all" if mode in ("audit", "plain") else case


def policy_order(jobs: Sequence[Job], cost: Callable[[Job], float] | None = None) -> list[Job]:
    """The scheduler's order for simulated jobs: references first, then the cases longest first (by their recorded
    seconds unless `cost` says otherwise)."""
    refs = [j for j in jobs if j.reference is None]
    return refs + longest_first([j for j in jobs if j.reference is not None], cost or (lambda j: j.cost))


def static_job_cost(job: Job, attempts: int = 3) -> float:
    """static_cost of a simulated job, read from its gate case id (a first run on an empty cache has nothing
    measured): a self control in plain may run again, an audit case costs more."""
    c = job.case
    return static_cost(
        job.reference is None, "-self-control" in c and c.endswith("-plain"), c.endswith("-audit"), attempts
    )


def without_early_stop(jobs: Sequence[Job]) -> list[Job]:
    return [replace(j, early_stop=False) for j in jobs]


def case_order(cases: Sequence[T], measured: dict[str, float], retried: Callable[[T], bool], attempts: int) -> list[T]:
    """The scheduler's cases (gate.case.GateCase) longest first: each one's seconds in this GPU's last run from the
    same cache folder (`measured`, GateCache.load_costs), else static_cost. Each build's first case expected clean
    (not a control) goes first all the same: the first case to start writes the build's vLLM cache
    (GateCache.case_cache), and one that runs to its end (a control may fault before its compile is saved) leaves
    the cache the others use."""

    def cost(c) -> float:
        got = measured.get(c.case_id)
        return got if got is not None else static_cost(c.reference, retried(c), c.mode.audit, attempts)

    ordered = longest_first(cases, cost)
    writers: list[T] = []
    for c in cases:
        if not c.is_control and all(w.build != c.build for w in writers):
            writers.append(c)
    return writers + [c for c in ordered if c not in writers]


def predict(tl: Timeline, after_s: float) -> dict[str, float]:
    """What the record's processes make of a run's wall (seconds from its start), simulated: `replay` (its own
    order and slots: the model's check against `recorded`), `cold_static` and `cold_measured` (this scheduler on
    empty caches, the static model's order and the measured one), `warm_before` and `warm` (on complete caches,
    references kept: the record's order and slots, and this scheduler's). This scheduler's limits are what it fits to
    the machine the record names (placement.fit_jobs, cold_jobs; counting processes) and its memory budget
    (run.MemoryBudget.of_free_gpu, FREE_AT_START of the total left free); else the record's slots."""
    jobs, _ = jobs_from_timeline(tl)
    warm_jobs, _ = jobs_from_timeline(tl, warm_run=True)
    now, _ = jobs_from_timeline(tl, now=True)
    warm_now, _ = jobs_from_timeline(tl, warm_run=True, now=True)
    workers, cold, budget, fitted = tl.workers, tl.workers, None, False
    if tl.cpus and tl.memory:
        free, total = tl.memory
        workers, cold = fit_jobs(tl.cpus, [(total, free)])[0], cold_jobs(tl.cpus)
        fitted_budget = MemoryBudget.of_free_gpu([(total, free)], keep_of_total=FREE_AT_START)
        budget, fitted = fitted_budget.total / GIB if fitted_budget else None, True
    new = dict(ref_slots=REF_SLOTS, cold_workers=min(cold, workers), budget_gib=budget, per_process=fitted)
    ready = tl.ready_s or 0.0
    warm = dict(cold=False, budget_gib=budget, per_process=fitted)
    return {
        "recorded": tl.wall_s,
        "replay": simulate(without_early_stop(jobs), tl.workers, ready, after_s).wall,
        "cold_static": simulate(policy_order(now, static_job_cost), workers, ready, after_s, **new).wall,
        "cold_measured": simulate(policy_order(now), workers, ready, after_s, **new).wall,
        "warm_before": simulate(without_early_stop(warm_jobs), tl.workers, ready, after_s, cold=False).wall,
        "warm": simulate(policy_order(warm_now), workers, ready, after_s, **warm).wall,
        "workers": workers,
        "cold_workers": min(cold, workers),
        "budget_gib": budget,
    }


def prediction_lines(name: str, tl: Timeline, after_s: float) -> list[str]:
    p = predict(tl, after_s)
    gib = p["budget_gib"]
    budget = f"{GIB_PER_CASE:g} GiB a process of {gib:.0f} GiB" if gib else "no memory budget (none recorded)"
    return [
        f"### {name}: this scheduler on the record's processes (simulated, seconds of wall)",
        "",
        f"- the model's check: the record's own order on its {tl.workers} slots {p['replay']:.1f} s "
        f"(recorded {p['recorded']:.1f} s)",
        f"- cold, {p['workers']} processes at once ({p['cold_workers']} on cold caches; a known-bad build's plain "
        f"rerun beside it is one of them, a self control's is not run), {budget}, references on slots of their own: "
        f"{p['cold_static']:.1f} s in the static model's order (an empty cache: nothing measured), "
        f"{p['cold_measured']:.1f} s in the measured order",
        f"- warm (compile loaded, references kept): {p['warm_before']:.1f} s in the record's order on its slots, "
        f"{p['warm']:.1f} s with this scheduler",
        "",
    ]
