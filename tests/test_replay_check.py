"""The replay-time check (repro.vllm_integration.plugin.replay) on test_descriptor_audit's CPU stand-in of the V2
runner, with a stand-in of torch 2.14's global replay-start hook (torch.cuda.graphs.register_graph_replay_start_hook)
and of torch.cuda.graph keeping the CUDAGraph it records: at sampled replays of a FULL draft graph, the buffers it
reads must hold what the runtime last built for the batch being replayed (a runtime that skipped or half-made its
copy is stale-replay, naming the graph's descriptor), the draft loop's own step is not; sampling bounds the checks and
their cost is counted; where torch has no such hook the check is off and says so."""

from __future__ import annotations

import types

import pytest

from repro.vllm_integration.plugin import backend_hooks, capture, counters, replay
from repro.vllm_integration.plugin.audit import STALE_REPLAY, in_words
from tests import test_descriptor_audit as sd

plugin_state = sd.plugin_state


class Graphs:
    """torch.cuda.graphs' stand-in: the global replay-start hooks, and every CUDAGraph recorded (in order)."""

    def __init__(self):
        self.hooks, self.recorded = [], []

    def register_graph_replay_start_hook(self, fn):
        self.hooks.append(fn)
        return types.SimpleNamespace(remove=lambda: self.hooks.remove(fn))

    def replay(self, graph):
        for fn in list(self.hooks):
            fn(graph)


@pytest.fixture
def hooked(plugin_state, monkeypatch):
    graphs = Graphs()

    class Graph(sd.FakeGraph):
        def __init__(self, cuda_graph, *a, **k):
            self.cuda_graph = cuda_graph
            graphs.recorded.append(cuda_graph)

    monkeypatch.setattr(sd.CUDA, "graph", Graph)
    monkeypatch.setattr(sd.CUDA, "graphs", graphs, raising=False)
    monkeypatch.setattr(capture, "_REPLAY", {})
    mod = sd._backend()
    assert backend_hooks.install(mod, sd.CUDA)
    runner = sd.Runner(mod)
    runner.capture_model()
    return runner, graphs


def draft_decode_graphs(graphs):
    """The draft decode manager's graphs (t8r8, t4r4, t1r1; the target's three, the draft prefill's three first)."""
    checker = capture._REPLAY["on"]
    return [(g, checker.graphs.get(g).label) for g in graphs.recorded if checker.graphs.get(g) is not None]


class RuntimeSpeculator:
    """The speculator at runtime: its eager build for a decode batch of n requests (outside every capture)."""

    def prepare(self, runner, n):
        return sd.prepare_inputs_to_capture(n, n, runner.builder, 1)


def runtime_batch(runner, n):
    return RuntimeSpeculator().prepare(runner, n)


def test_a_replay_after_no_draft_build_is_unjudged_and_the_targets_build_is_no_reference(hooked):
    """vLLM 0.34.0's fused draft graph computes its metadata in place from what the speculator's kernels wrote: a
    replay after only the target's build (its buffers then rewritten by those kernels) is counted, never compared."""
    runner, graphs = hooked
    sd.prepare_inputs_to_capture(4, 16, runner.builder, 4)  # the target's verify build (no speculator on the stack)
    sd.BUF["seq_lens"][:4] = 7  # the speculator's kernels write the draft's inputs
    graphs.replay(draft_decode_graphs(graphs)[0][0])
    assert counters.COUNTERS["replay_unjudged"] == {replay.NO_BUILD: 1} and not counters.AUDITOR.mismatches


def test_only_the_drafts_full_graphs_are_watched_and_the_check_says_it_is_on(hooked):
    _runner, graphs = hooked
    labels = [label for _g, label in draft_decode_graphs(graphs)]
    assert counters.COUNTERS["replay_check"] == "on" and counters.COUNTERS["replay_graphs"] == len(labels) == 8
    assert not any(label.startswith("target") for label in labels)
    assert "draft decode FULL t4r4 q1 k3" in labels


def test_a_replay_on_the_runtimes_own_build_is_clean(hooked):
    runner, graphs = hooked
    runtime_batch(runner, 4)
    graph, _ = next(x for x in draft_decode_graphs(graphs) if x[1].endswith("t4r4 q1 k3"))
    graphs.replay(graph)
    runtime_batch(runner, 4)
    sd.BUF["seq_lens"][:4] += 1  # the draft loop's step after its build, before the replay: not stale
    graphs.replay(graph)
    assert counters.COUNTERS["replay_checks"] == 2 and not counters.AUDITOR.mismatches
    assert not counters.COUNTERS["replay_unjudged"]  # every view it reads was compared


def test_a_buffer_the_runtime_left_half_copied_is_stale_replay_naming_the_graph(hooked):
    runner, graphs = hooked
    runtime_batch(runner, 4)
    sd.BUF["seq_lens"][2] = 99  # a later partial write the runtime did not redo for this batch
    graph, label = next(x for x in draft_decode_graphs(graphs) if x[1].endswith("t4r4 q1 k3"))
    graphs.replay(graph)
    found = [m for m in counters.AUDITOR.mismatches if m.kind == STALE_REPLAY]
    assert found and found[0].descriptor == label and found[0].buffer == "seq_lens"
    assert (found[0].index, found[0].now) == (2, 99)
    assert "stale at replay of draft decode FULL t4r4 q1 k3" in in_words(found[0].to_dict())


def test_a_view_no_runtime_build_wrote_is_counted_unjudged(hooked, monkeypatch):
    _runner, graphs = hooked
    checker = capture._REPLAY["on"]
    checker.fresh = True  # a draft build of other buffers only: none of this graph's views has one
    graphs.replay(draft_decode_graphs(graphs)[0][0])
    assert set(counters.COUNTERS["replay_unjudged"]) >= {"seq_lens", "query_start_loc"}
    assert not counters.AUDITOR.mismatches


def test_sampling_bounds_the_checks_and_their_cost_is_counted(hooked):
    runner, graphs = hooked
    runtime_batch(runner, 4)
    graph, _ = draft_decode_graphs(graphs)[0]
    for _ in range(100):
        runtime_batch(runner, 4)
        graphs.replay(graph)
    want = replay.FIRST + len(range(replay.FIRST, 100, replay.EVERY))
    assert counters.COUNTERS["replays_seen"] == 100 and counters.COUNTERS["replay_checks"] == want
    assert counters.COUNTERS["replay_check_s"] > 0


def test_without_the_global_hook_the_check_is_off_and_says_so(plugin_state, monkeypatch):
    monkeypatch.setattr(capture, "_REPLAY", {})
    cuda = types.SimpleNamespace(graph=sd.FakeGraph, graphs=types.SimpleNamespace())
    assert backend_hooks.install(sd._backend(), cuda)
    assert counters.COUNTERS["replay_check"].startswith("off: torch")
    assert "register_graph_replay_start_hook" in counters.COUNTERS["replay_check"]
    assert "on" not in capture._REPLAY


@pytest.fixture(autouse=True)
def _asked_for(monkeypatch):
    """The check is off by default (a false alarm on a healthy 0.34.0): these tests turn it on."""
    from repro.vllm_integration.plugin import replay  # noqa: PLC0415  the module whose switch the test turns

    monkeypatch.setattr(replay, "ON", True)
