"""The replay-time check (repro.vllm_integration.plugin.replay) on test_descriptor_audit's CPU stand-in of the V2
runner, with a stand-in of torch 2.14's global replay-start hook (torch.cuda.graphs.register_graph_replay_start_hook)
and of torch.cuda.graph keeping the CUDAGraph it records: at sampled replays of a FULL draft graph, the buffers it
reads must hold what the runtime last built for the batch being replayed (a runtime that skipped or half-made its
copy is stale-replay, naming the graph's descriptor), the draft loop's own step is not; sampling bounds the checks and
their cost is counted; where torch has no such hook the check is off and says so."""

from __future__ import annotations

import types

import pytest
import torch

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

    def prepare(self, runner, n, tokens=None, q=1):
        return sd.prepare_inputs_to_capture(n, tokens or n, runner.builder, q)


def runtime_batch(runner, n):
    return RuntimeSpeculator().prepare(runner, n)


def graph_of(graphs, suffix):
    return next(g for g, label in draft_decode_graphs(graphs) if label.endswith(suffix))


class StandaloneARSpeculator:
    """vLLM 0.34.0's draft_model speculator at runtime (standalone_ar/speculator.py, propose): its expanded prefill,
    each request's query and a correction token (q + 1 tokens), built eagerly (a prompt's prefill is no uniform
    batch: no FULL prefill graph); then _prepare_decode_inputs' kernels write the decode batch (query_start_loc an
    arange, seq_lens, the slots, -1 past the batch) into the same buffers with no build, and the fused decode graph
    (one token a request) replays."""

    def propose(self, runner, graphs, n, prompt):
        sd.prepare_inputs_to_capture(n, n * (prompt + 1), runner.builder, prompt + 1)  # the expanded prefill's build
        assert capture._REPLAY["on"].kept, "the prefill's build was not kept as the speculator's"
        sd.BUF["slot_mapping"][0] = 84
        sd.BUF["query_start_loc"][: n + 1] = torch.arange(n + 1)  # the decode inputs, written by kernels
        sd.BUF["seq_lens"][:n] = prompt + 2
        sd.BUF["slot_mapping"][:n] = 256 + torch.arange(n)
        graphs.replay(graph_of(graphs, f"t{n}r{n} q1 k3"))


def test_draft_models_decode_replay_after_its_prefill_build_is_unjudged_not_stale(hooked):
    """The false alarm of a healthy vLLM 0.34.0 (H100, draft_model: stale at replay of draft decode FULL t4r4 q1,
    query_start_loc[1] 1 where the prefill's build wrote 5, slot_mapping[0] 256 where it wrote 84): the decode
    graph's batch has no build of its own; the prefill's, for another graph, is no reference for it."""
    runner, graphs = hooked
    StandaloneARSpeculator().propose(runner, graphs, 4, prompt=4)
    assert not counters.AUDITOR.mismatches
    assert counters.COUNTERS["replay_unjudged"] == {replay.OTHER_GRAPH: 1} and counters.COUNTERS["replay_checks"] == 0


class DFlashSpeculator:
    """vLLM 0.34.0's DFlash at runtime (dflash/speculator.py, propose): a batch no FULL query graph holds (more
    requests than its largest, or a profile run) is built eagerly and runs without a graph; a batch one holds replays
    it with no build (the graph refreshes its metadata in place)."""

    def eager(self, runner, n):
        sd.prepare_inputs_to_capture(n, 4 * n, runner.builder, 4)
        assert capture._REPLAY["on"].kept, "the eager build was not kept as the speculator's"

    def replay(self, graphs, n):
        sd.BUF["query_start_loc"][: n + 1] = torch.arange(n + 1) * 4  # prepare_dflash_inputs' kernels, which pad
        sd.BUF["query_start_loc"][n + 1 :] = 4 * n  # the entries past the batch with its total
        sd.BUF["seq_lens"][:n] = 8
        graphs.replay(graph_of(graphs, f"t{4 * n}r{n} q4"))


def test_dflash_query_replay_after_an_eager_build_for_another_batch_is_unjudged_not_stale(hooked):
    """The false alarm of a healthy vLLM 0.34.0 (H100, dflash: stale at replay of draft query FULL t16r4 q4,
    query_start_loc[5] 16 where a build of five requests or more wrote 20, seq_lens[0] 8 where it wrote 5)."""
    runner, graphs = hooked
    d = DFlashSpeculator()
    d.eager(runner, 5)
    d.replay(graphs, 4)
    d.replay(graphs, 4)  # the next step's: nothing built since the last replay
    assert not counters.AUDITOR.mismatches
    assert counters.COUNTERS["replay_unjudged"] == {replay.OTHER_GRAPH: 1, replay.NO_BUILD: 1}


def test_a_build_kept_from_an_earlier_batch_is_no_reference_after_the_targets_next_build(hooked):
    """A draft build of the graph's very shape, made for an earlier batch (an eager step), then the target's build of
    the next batch and the speculator's kernels: the replay of the next batch is not judged against it."""
    runner, graphs = hooked
    runtime_batch(runner, 4)
    sd.prepare_inputs_to_capture(4, 16, runner.builder, 4)  # the next step's target build (no speculator on the stack)
    sd.BUF["seq_lens"][:4] = 30
    graphs.replay(graph_of(graphs, "t4r4 q1 k3"))
    assert not counters.AUDITOR.mismatches and counters.COUNTERS["replay_unjudged"] == {replay.NO_BUILD: 1}


def test_every_graph_of_a_pass_is_judged_on_its_own_build_only(hooked):
    """A pass that builds for two graphs (a FULL prefill then a non-fused decode step): each replay pairs with the
    build made for it, the half-copied decode batch is stale-replay naming the decode graph alone."""
    runner, graphs = hooked
    RuntimeSpeculator().prepare(runner, 2, 8, 4)  # the FULL draft prefill's build (t8r2 q4)
    graphs.replay(graph_of(graphs, "t8r2 q4"))
    runtime_batch(runner, 4)  # the decode step's build (t4r4 q1)
    sd.BUF["query_start_loc"][3] = 9  # a partial copy over it before the replay
    graphs.replay(graph_of(graphs, "t4r4 q1 k3"))
    found = [m for m in counters.AUDITOR.mismatches if m.kind == STALE_REPLAY]
    assert [(m.descriptor, m.buffer, m.index, m.now) for m in found] == [
        ("draft decode FULL t4r4 q1 k3", "query_start_loc", 3, 9)
    ]
    assert counters.COUNTERS["replay_checks"] == 2 and not counters.COUNTERS["replay_unjudged"]


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
    graph = graph_of(graphs, "t4r4 q1 k3")
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
    graph = graph_of(graphs, "t4r4 q1 k3")
    graphs.replay(graph)
    found = [m for m in counters.AUDITOR.mismatches if m.kind == STALE_REPLAY]
    assert found and found[0].descriptor == "draft decode FULL t4r4 q1 k3" and found[0].buffer == "seq_lens"
    assert (found[0].index, found[0].now) == (2, 99)
    assert "stale at replay of draft decode FULL t4r4 q1 k3" in in_words(found[0].to_dict())


def test_a_view_no_build_for_the_graph_wrote_is_counted_unjudged(hooked):
    """A runtime build for the graph's batch whose block table is another buffer (vLLM's FULL replays read the
    kernel block table _map_kernel_block_tables fills): that view of the graph is counted, the rest compared."""
    runner, graphs = hooked
    cm = sd.CommonAttentionMetadata(
        sd.BUF["query_start_loc"][:5], sd.BUF["seq_lens"][:4], 4, 4, 1,
        torch.zeros(4, 4, dtype=torch.int32), sd.BUF["slot_mapping"][:4],
    )  # fmt: skip
    sd.BUF["query_start_loc"][:5] = torch.arange(5)
    RuntimeSpeculator.build = lambda self, cm: runner.builder.build(0, cm)
    RuntimeSpeculator().build(cm)
    graphs.replay(graph_of(graphs, "t4r4 q1 k3"))
    assert counters.COUNTERS["replay_unjudged"] == {"block_table": 1} and counters.COUNTERS["replay_checks"] == 1
    assert not counters.AUDITOR.mismatches


def test_sampling_bounds_the_checks_and_their_cost_is_counted(hooked):
    runner, graphs = hooked
    graph = graph_of(graphs, "t4r4 q1 k3")
    for _ in range(100):
        runtime_batch(runner, 4)
        graphs.replay(graph)
    want = replay.FIRST + len(range(replay.FIRST, 100, replay.EVERY))
    assert counters.COUNTERS["replays_seen"] == 100 and counters.COUNTERS["replay_checks"] == want
    assert counters.COUNTERS["replay_check_s"] > 0


def test_a_request_may_turn_the_check_off_and_the_counters_say_so(plugin_state, monkeypatch):
    graphs = Graphs()
    monkeypatch.setattr(capture, "_REPLAY", {})
    cuda = types.SimpleNamespace(graph=sd.FakeGraph, graphs=graphs)
    assert backend_hooks.install(sd._backend(), cuda, check_replay=False)
    assert counters.COUNTERS["replay_check"] == replay.OFF and not graphs.hooks and "on" not in capture._REPLAY


def test_without_the_global_hook_the_check_is_off_and_says_so(plugin_state, monkeypatch):
    monkeypatch.setattr(capture, "_REPLAY", {})
    cuda = types.SimpleNamespace(graph=sd.FakeGraph, graphs=types.SimpleNamespace())
    assert backend_hooks.install(sd._backend(), cuda)
    assert counters.COUNTERS["replay_check"].startswith("off: torch")
    assert "register_graph_replay_start_hook" in counters.COUNTERS["replay_check"]
    assert "on" not in capture._REPLAY


@pytest.mark.parametrize(("refresh", "check"), [(True, True), (False, True), (True, False)])
def test_the_plugin_installs_the_auditor_with_the_checks_its_request_asks_for(monkeypatch, refresh, check):
    from repro.contract import request  # noqa: PLC0415  the request the plugin reads
    from repro.vllm_integration import plugin  # noqa: PLC0415  the plugin's register, as vLLM calls it
    from tests.case_requests import plugin_request  # noqa: PLC0415  a request with every key given

    seen = {}
    monkeypatch.setattr(plugin, "install", lambda backend, spec, **kw: seen.update(kw) or False)
    monkeypatch.setattr(plugin, "install_probe", lambda *a, **k: False)
    monkeypatch.setattr(plugin.importlib, "import_module", lambda name: types.ModuleType(name))
    monkeypatch.setattr(counters, "_installed", set())
    asked = plugin_request(probe=True, audit=True, judge_refresh=refresh, check_replay=check)
    monkeypatch.setenv(request.ENV, asked.to_json())
    plugin.register()
    assert seen == {"judge_refresh": refresh, "check_replay": check}


def test_a_replay_check_that_raises_is_counted_unjudged_and_never_stops_the_replay(hooked, monkeypatch):
    """The replay-start hook runs inside torch's replay and the build hook inside vLLM's loop: an error of the check
    itself is counted in replay_unjudged with its type, and the replay and the build go on."""
    runner, graphs = hooked
    checker = capture._REPLAY["on"]

    def broken(*a, **k):
        raise RuntimeError("the check broke")

    monkeypatch.setattr(checker, "built", broken)
    monkeypatch.setattr(checker, "on_replay", broken)
    runtime_batch(runner, 4)
    graphs.replay(graph_of(graphs, "t4r4 q1 k3"))
    unjudged = counters.COUNTERS["replay_unjudged"]
    assert unjudged["the check raised at a build: RuntimeError"] >= 1
    assert unjudged["the check raised at a replay: RuntimeError"] == 1 and not counters.AUDITOR.mismatches
