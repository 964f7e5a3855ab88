"""The replay-time check: where torch has the global CUDA-graph hooks (torch 2.14:
torch.cuda.graphs.register_graph_replay_start_hook, a hook run with each graph just before every replay), at sampled
replays of the draft's FULL graphs, the persistent buffers the graph reads hold what the runtime built for the batch
being replayed. The capture-time checks see the other side of the bug class: a runtime that skips or half-copies a
batch's metadata into the buffers a graph baked in replays that graph on another batch's.

Which build is the replay's: a speculator makes eager metadata builds for several graphs in one draft pass (vLLM
0.34.0's StandaloneARSpeculator builds its expanded prefill, q + 1 tokens a request, then replays its decode graph,
one token a request, on buffers its kernels rewrote with no build; DFlash builds only where its query graph does not
run). So each eager runtime build of the speculator (outside every capture, a speculator frame on its stack) is kept
with its shape (tokens, requests, longest query) and its views (data pointer, length and field path: what it wrote)
until the next replay of a watched graph, the next build that is not the speculator's (the step's target build: a new
batch) or the next capture. A sampled replay of a FULL draft graph (captured while the auditor was on: its
descriptor and the views of the metadata its forwards used) is judged only against a kept build made for that graph:
its shape the graph's descriptor (the tokens and requests it was captured for, its query length: equal for a uniform
descriptor, at most for another) and its views the graph's own. Each view the graph reads must show what the latest
such build wrote, the draft loop's own in-place step aside (the auditor's loop-advance rule: seq_lens and slot_mapping
moved uniformly by 1 <= d <= MAX_ADVANCE); a difference is a Mismatch of kind stale-replay naming the graph's
descriptor. A replay with no kept build (vLLM 0.34.0's fused draft decode and DFlash query graphs compute their
metadata in place from what the speculator's kernels wrote: no build to compare with), one whose kept builds were all
for other graphs, and a view of the graph no such build wrote are counted (replay_unjudged, by reason), never clean.
The target's builds are not the draft's reference: the speculator's kernels write the draft's inputs into the
shared buffers after them.

Sampling bounds the cost (each check copies the views to the host and synchronises): the first FIRST replays of each
graph, then every EVERY-th. What it cost is counted: replays seen, checked, and the seconds the checks took
(replay_check_s), beside the run's wall time. Where torch lacks the hook, or the request asks for no replay check
(PluginRequest.check_replay false), the check is off and the counters say why (replay_check)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from repro.vllm_integration.plugin.audit import STALE_REPLAY, CaptureDescriptor, FreshnessAuditor, Mismatch, _ints
from repro.vllm_integration.plugin.identity import ByIdentity
from repro.vllm_integration.plugin.inject import bump as _bump

HOOK = "register_graph_replay_start_hook"  # torch.cuda.graphs' global replay hook (torch 2.14)
FIRST, EVERY = 4, 16  # per graph: its first FIRST replays, then every EVERY-th
NO_BUILD = "no draft build for this batch (the graph computes its metadata in place)"
OTHER_GRAPH = "the draft builds for this batch were for other graphs (another shape or other views)"
OFF = "off: the request asks for no replay check (check_replay false)"
MAX_ADVANCE = 8  # the draft loop's in-place step bound (capture.MAX_DRAFT_LOOP_ADVANCE)

Key = tuple[int, int, str]  # a view: (its data pointer, its length, its field path)


def guarded(counters: dict[str, Any], what: str, fn: Any, *args: Any, default: Any = None) -> Any:
    """fn(*args), the replay check's part at `what` (a build, a capture's end, a replay): an exception it raises is
    counted in replay_unjudged with its type, never raised into vLLM's loop or torch's replay hook (default returned)."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001  a check that broke judged nothing, and says so
        _bump(counters, "replay_unjudged", f"the check raised at {what}: {type(e).__name__}")
        return default


@dataclass
class _Graph:
    label: str  # the graph's kind and descriptor, as the capture tracker read them
    desc: CaptureDescriptor  # the FULL descriptor it was captured for
    views: dict[Key, Any]  # each view its metadata showed
    replays: int = 0


@dataclass
class _Build:
    label: str
    shape: dict[str, Any]  # what it was built for (metadata_views.build_shape)
    values: dict[Key, list]  # what it wrote, per view


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


def _key(path: str, view: Any) -> Key | None:
    if view is None or not hasattr(view, "data_ptr") or not hasattr(view, "numel"):
        return None
    return view.data_ptr(), view.numel(), path


def made_for(shape: dict[str, Any], desc: CaptureDescriptor) -> bool:
    """Was a build of this shape made for a graph of this descriptor: its tokens and requests the descriptor's (a
    FULL graph's runtime build is padded to them), its longest query the descriptor's (uniform) or within it?"""
    if desc.num_reqs is None or shape.get("num_actual_tokens") != desc.num_tokens:
        return False
    if shape.get("num_reqs") != desc.num_reqs:
        return False
    q, longest = desc.query_len, shape.get("max_query_len")
    if q is None:
        return True
    return isinstance(longest, int) and (longest == q if desc.uniform else longest <= q)


@dataclass
class ReplayChecker:
    counters: dict[str, Any]
    first: int = FIRST
    every: int = EVERY
    graphs: ByIdentity[_Graph] = field(default_factory=ByIdentity)
    kept: list[_Build] = field(default_factory=list)  # the speculator's runtime builds for the batch under way
    mismatches: list[Mismatch] = field(default_factory=list)

    def built(self, label: str, views: dict[str, Any], shape: dict[str, Any], draft: bool) -> None:
        """An eager metadata build: a runtime build of the speculator (`draft`: a speculator frame on its stack, no
        capture loop) is kept for the replays of the batch under way (see the module); any other build (the step's
        target build, a capture pass's) begins another batch, and no build kept before it is that batch's. Copies
        to the host (as the auditor's record_build does)."""
        if not draft:
            self.kept.clear()
            return
        values = {k: _ints(v) for p, v in views.items() if (k := _key(p, v)) is not None}
        self.kept.append(_Build(label, shape, values))

    def captured(self, graph: Any, label: str, desc: CaptureDescriptor, views: dict[str, Any]) -> None:
        """A FULL draft graph's capture ended: its descriptor and the views of the metadata it read, kept for its
        replays."""
        self.kept.clear()
        if graph is None:
            return
        kept = {k: v for p, v in views.items() if (k := _key(p, v)) is not None}
        self.graphs[graph] = _Graph(label, desc, kept)
        _bump(self.counters, "replay_graphs")

    def on_replay(self, graph: Any) -> list[Mismatch]:
        """The replay-start hook: a sampled replay of a known graph checked against the builds made for it (see the
        module); others counted. Every replay of a watched graph ends the builds kept for it."""
        g = self.graphs.get(graph)
        if g is None:
            return []
        g.replays += 1
        _bump(self.counters, "replays_seen")
        kept, self.kept = self.kept, []
        n = g.replays - 1
        if n >= self.first and (n - self.first) % self.every:
            return []
        mine = [b for b in kept if made_for(b.shape, g.desc) and any(k in b.values for k in g.views)]
        if not mine:
            _bump(self.counters, "replay_unjudged", OTHER_GRAPH if kept else NO_BUILD)
            return []
        started = time.perf_counter()
        found = self._compare(g, mine)
        _bump(self.counters, "replay_checks")
        self.counters["replay_check_s"] = round(
            self.counters.get("replay_check_s", 0.0) + time.perf_counter() - started, 6
        )
        self.mismatches += found
        return found

    def _compare(self, g: _Graph, mine: list[_Build]) -> list[Mismatch]:
        """Each view of g against the latest of `mine` that wrote it, the views of one build compared together (the
        loop-advance rule reads seq_lens and slot_mapping of one check); a view none wrote counted unjudged."""
        by_build: dict[int, list[Key]] = {}
        for key in g.views:
            i = next((i for i in range(len(mine) - 1, -1, -1) if key in mine[i].values), None)
            if i is None:
                _bump(self.counters, "replay_unjudged", key[2])
                continue
            by_build.setdefault(i, []).append(key)
        found: list[Mismatch] = []
        for i, keys in by_build.items():
            b = mine[i]
            while keys:  # one check holds one view per field path
                one = {k[2]: k for k in keys}
                keys = [k for k in keys if one[k[2]] is not k]
                auditor, token = FreshnessAuditor(), object()
                auditor.record_build(token, b.label, {p: b.values[k] for p, k in one.items()}, b.shape)
                for m in auditor.check(token, {p: g.views[k] for p, k in one.items()}, advance=MAX_ADVANCE):
                    found.append(Mismatch(g.label, m.buffer, m.field, m.index, m.built, m.now, STALE_REPLAY))
        return found


def hook_of(cuda: Any) -> tuple[Any, str | None]:
    """(torch.cuda.graphs' replay-start hook registrar, None) where torch has it; (None, why the check is off)."""
    graphs = getattr(cuda, "graphs", None)
    register = getattr(graphs, HOOK, None)
    if register is None:
        version = getattr(getattr(cuda, "_torch", None), "__version__", None)
        return None, f"off: torch{' ' + version if version else ''} has no torch.cuda.graphs.{HOOK} (torch 2.14 on)"
    return register, None
