"""The replay-time check: where torch has the global CUDA-graph hooks (torch 2.14:
torch.cuda.graphs.register_graph_replay_start_hook, a hook run with each graph just before every replay), at sampled
replays of the draft's FULL graphs, the persistent buffers the graph reads hold what the runtime last built for the
batch being replayed. The capture-time checks see the other side of the bug class: a runtime that skips or
half-copies a batch's metadata into the buffers a graph baked in replays that graph on another batch's.

What is compared: every eager metadata build the speculator makes (outside any capture, a speculator frame on its
stack) is recorded per buffer view (the view's storage and field path: what it wrote, its descriptor); at a sampled
replay of a FULL draft graph (captured while the auditor was on: its descriptor and the views of the metadata its
forwards used) that follows such a build, each of those views' latest draft build must still show what it wrote,
the draft loop's own in-place step aside (the auditor's loop-advance rule: seq_lens and slot_mapping moved uniformly
by 1 <= d <= MAX_DRAFT_LOOP_ADVANCE). A replay with no draft build since the previous one (vLLM 0.34.0's fused draft
decode graph refreshes its metadata in place from what the speculator's kernels wrote: no build to compare with),
and a view no draft build wrote, are counted (replay_unjudged, by reason), never clean. A difference is a Mismatch of
kind stale-replay naming the graph's descriptor. The target's builds are not the draft's reference: the speculator's
kernels write the draft's inputs into the shared buffers after them.

Sampling bounds the cost (each check copies the views to the host and synchronises): the first FIRST replays of each
graph, then every EVERY-th. What it cost is counted: replays seen, checked, and the seconds the checks took
(replay_check_s), beside the run's wall time. Where torch lacks the hook the check is off, and the counters say so
(replay_check: the reason)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from repro.vllm_integration.plugin.audit import STALE_REPLAY, FreshnessAuditor, Mismatch
from repro.vllm_integration.plugin.identity import ByIdentity
from repro.vllm_integration.plugin.inject import bump as _bump

# opt-in: on a healthy vLLM 0.34.0 (H100, results/h100-gate-default-cold) the check called draft_model's decode graph
# stale at replay (query_start_loc[1] 1 where the latest runtime build wrote 2: that build was not the one replayed),
# a false alarm, so off until it pairs each replay with the build made for it and a GPU record shows it clean
ON = False


def enabled() -> bool:
    """Is the replay check on (ON)?"""
    return ON


HOOK = "register_graph_replay_start_hook"  # torch.cuda.graphs' global replay hook (torch 2.14)
FIRST, EVERY = 4, 16  # per graph: its first FIRST replays, then every EVERY-th
NO_BUILD = "no draft build since the last draft replay (the graph computes its metadata in place)"
MAX_ADVANCE = 8  # the draft loop's in-place step bound (capture.MAX_DRAFT_LOOP_ADVANCE)


@dataclass
class _Graph:
    label: str  # the graph's kind and descriptor, as the capture tracker read them
    views: dict[tuple[int, str], Any]  # (storage pointer, field path) -> a view the graph's metadata showed
    replays: int = 0


def runtime(frame: Any, depth: int = 60) -> bool:
    """Is a build at this frame the runtime's: no *CudaGraphManager*'s capture loop on its stack (a capture pass's
    builds are the capture's)? Reads a frame's locals only where its function is named capture."""
    f = frame
    for _ in range(depth):
        if f is None:
            return True
        if f.f_code.co_name == "capture" and "CudaGraphManager" in type(f.f_locals.get("self")).__name__:
            return False
        f = f.f_back
    return True


def _ptr(view: Any) -> int:
    return view.untyped_storage().data_ptr()


@dataclass
class ReplayChecker:
    counters: dict[str, Any]
    first: int = FIRST
    every: int = EVERY
    graphs: ByIdentity[_Graph] = field(default_factory=ByIdentity)
    # (storage pointer, field path) -> the latest runtime build's record of that view (a FreshnessAuditor of its own:
    # its keys are these pairs, its builds what each view's latest build wrote)
    latest: FreshnessAuditor = field(default_factory=FreshnessAuditor)
    live: dict[tuple[int, str], Any] = field(default_factory=dict)  # the same pairs -> that build's view
    # each pair's one key object: `latest` knows its builds by identity, and an equal tuple made later is another object
    keys: dict[tuple[int, str], tuple[int, str]] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)

    fresh: bool = False  # a draft build was recorded since the last replay of a watched graph

    def built(self, label: str, views: dict[str, Any], draft: bool) -> None:
        """An eager metadata build (outside every capture): a draft's (a speculator on its stack) is the latest build
        of each of its views' buffers. The target's are not: the speculator's own kernels write the draft's inputs
        into shared buffers after them. Copies to the host (as the auditor's record_build does)."""
        if not draft:
            return
        self.fresh = True
        for path, view in views.items():
            if view is None or not hasattr(view, "untyped_storage"):
                continue
            key = self.keys.setdefault((_ptr(view), path), (_ptr(view), path))
            self.live[key] = view
            self.latest.record_build(key, label, {path: view})

    def captured(self, graph: Any, label: str, views: dict[str, Any]) -> None:
        """A FULL draft graph's capture ended: the views of the metadata it read, kept for its replays."""
        if graph is None:
            return
        kept = {(_ptr(v), p): v for p, v in views.items() if v is not None and hasattr(v, "untyped_storage")}
        self.graphs[graph] = _Graph(label, kept)
        self.fresh = False
        _bump(self.counters, "replay_graphs")

    def on_replay(self, graph: Any) -> list[Mismatch]:
        """The replay-start hook: a sampled replay of a known graph checked (see the module); others counted."""
        g = self.graphs.get(graph)
        if g is None:
            return []
        g.replays += 1
        _bump(self.counters, "replays_seen")
        fresh, self.fresh = self.fresh, False
        n = g.replays - 1
        if n >= self.first and (n - self.first) % self.every:
            return []
        if not fresh:  # a fused draft graph computes its metadata from what the speculator's kernels wrote
            _bump(self.counters, "replay_unjudged", NO_BUILD)
            return []
        started = time.perf_counter()
        found: list[Mismatch] = []
        for pair in g.views:
            key = self.keys.get(pair)
            if key is None or not self.latest.knows(key):
                _bump(self.counters, "replay_unjudged", pair[1])
                continue
            for m in self.latest.check(key, {key[1]: self.live[key]}, advance=MAX_ADVANCE):
                found.append(Mismatch(g.label, m.buffer, m.field, m.index, m.built, m.now, STALE_REPLAY))
        _bump(self.counters, "replay_checks")
        self.counters["replay_check_s"] = round(
            self.counters.get("replay_check_s", 0.0) + time.perf_counter() - started, 6
        )
        self.mismatches += found
        return found


def hook_of(cuda: Any) -> tuple[Any, str | None]:
    """(torch.cuda.graphs' replay-start hook registrar, None) where torch has it; (None, why the check is off)."""
    graphs = getattr(cuda, "graphs", None)
    register = getattr(graphs, HOOK, None)
    if register is None:
        version = getattr(getattr(cuda, "_torch", None), "__version__", None)
        return None, f"off: torch{' ' + version if version else ''} has no torch.cuda.graphs.{HOOK} (torch 2.14 on)"
    return register, None
