"""The self control's injector (repro.vllm_integration.plugin.inject) on real tensors: what a target capture build leaves
is written into a draft capture's buffers, only the defect's fields, once per pass, never while a graph records;
capture_role reads the call stack as vLLM's managers shape it; FA3's never-written entries get the fill."""

from __future__ import annotations

import sys

import torch

from repro.backends.layout import VLLM, metadata_layout
from repro.vllm_integration.plugin.inject import StaleCaptureInjector, capture_pass, capture_role
from tests.reused_address import reborn


class CudaGraphManager:
    def capture(self, fn):
        return fn()


class SpeculatorCudaGraphManager(CudaGraphManager):
    pass


class Speculator:
    def capture(self, fn):
        return SpeculatorCudaGraphManager().capture(fn)


def _here():
    return capture_role(sys._getframe(1))


def test_capture_role_reads_the_managers_on_the_stack():
    assert _here() is None  # outside every capture
    assert CudaGraphManager().capture(_here) == "target"
    assert Speculator().capture(_here) == "draft"
    assert SpeculatorCudaGraphManager().capture(_here) == "draft"  # the speculator's own manager class says so


def _buffers():
    return {"query_start_loc": torch.zeros(9, dtype=torch.int32), "seq_lens": torch.zeros(8, dtype=torch.int32)}


def _build(buf, n):
    buf["query_start_loc"][: n + 1] = torch.arange(n + 1) * 4
    buf["query_start_loc"][n + 1 :] = 4 * n
    buf["seq_lens"][:n], buf["seq_lens"][n:] = 100 + n, 0
    block = torch.arange(8, dtype=torch.int32) + 10 * n  # the KV-cache addressing: never injected
    return {"query_start_loc": buf["query_start_loc"][: n + 1], "seq_lens": buf["seq_lens"][:n], "block_table": block}


def test_the_draft_capture_gets_the_target_last_capture_contents():
    counters: dict = {}
    announced = []
    inj = StaleCaptureInjector(counters, announce=announced.append, keep="last")
    buf = _buffers()
    for n in (8, 1):  # the target captures largest first: its last build is the smallest descriptor
        assert inj.target_built(f"t{4 * n}r{n}", _build(buf, n))
    assert inj.source == "t4r1" and counters["inject_snapshots"] == 2
    views = _build(buf, 8)  # the draft's own build for t32r8
    block = views["block_table"].clone()
    assert inj.inject(1, views, "draft build")
    assert views["seq_lens"].tolist() == [101] + [0] * 7  # the buffers hold t4r1's build now
    assert views["query_start_loc"].tolist()[:3] == [0, 4, 4]
    assert torch.equal(views["block_table"], block)  # not the defect's field: left alone
    assert counters["inject_fields"] == {"query_start_loc": 1, "seq_lens": 1}
    assert announced == [{"injection_wrote": "draft build", "source": "t4r1", "fields": sorted(views)}]
    assert inj.inject(1, views, "draft warmup")  # the same metadata in the same pass: written once
    assert counters["inject_writes"] == {"draft build": 1}
    assert inj.reached(views) and not inj.reached({"x": torch.zeros(2)})
    _build(buf, 8)  # vLLM rebuilds for the captured pass
    inj.capture_begins("draft prefill")  # before recording: written again, nothing inside the graph
    assert buf["seq_lens"].tolist() == [101] + [0] * 7 and counters["inject_writes"]["capture begins"] == 1
    inj.capture_begins("target decode")  # a target capture forgets the draft's last write
    assert inj.last == []


def test_by_default_the_draft_capture_gets_the_target_first_capture_contents():
    counters: dict = {}
    inj = StaleCaptureInjector(counters)
    buf = _buffers()
    for n in (8, 1):  # the first build is the largest descriptor's: the contents furthest from a small draft batch
        inj.target_built(f"t{4 * n}r{n}", _build(buf, n))
    assert inj.source == "t32r8" and counters["inject_snapshots"] == 1
    views = _build(buf, 1)  # the draft's own build for t4r1
    assert inj.inject(1, views, "draft build")
    assert buf["seq_lens"].tolist() == [108] * 8 and buf["query_start_loc"].tolist() == [
        0,
        4,
        8,
        12,
        16,
        20,
        24,
        28,
        32,
    ]


def test_no_target_capture_means_nothing_to_write():
    counters: dict = {}
    inj = StaleCaptureInjector(counters)
    assert not inj.inject(1, _build(_buffers(), 4), "draft warmup")
    assert counters["inject_no_source"] == {"draft warmup": 1} and "inject_writes" not in counters


def test_fa3_never_written_entries_get_the_fill():
    lay = metadata_layout(VLLM, 1, 1, True, False)
    sched = torch.zeros(lay.size + 16, dtype=torch.int32)
    inj = StaleCaptureInjector({})
    assert inj.target_built("t4r1", {"scheduler_metadata": sched[: lay.size]})
    inj.fill_padding(lay, "int-max")
    snap = inj.snapshots["scheduler_metadata"].view(torch.int32)
    assert [int(snap[i]) for i in lay.padding_indices()] == [2**31 - 1] * len(lay.padding_indices())
    assert int(sched[lay.padding_indices()[0]]) == 0  # the copy is filled, the live buffer untouched


class _Mode:
    def __init__(self, name):
        self.name = name


class _Desc:
    def __init__(self, n, mode="FULL"):
        self.num_tokens, self.cg_mode = n, _Mode(mode)


class DraftCudaGraphManager(CudaGraphManager):
    """As vLLM 0.26-0.33 shape a draft capture: the manager's capture calls create_forward_fn(desc, warmup) for the
    warmup pass and again for the captured pass of every descriptor, largest first; each call builds metadata."""

    def capture(self, build, descs):
        got = []

        def create_forward_fn(desc, warmup):
            return build(desc.num_tokens)

        for desc in descs:
            got.append((desc.num_tokens, create_forward_fn(desc, warmup=True), create_forward_fn(desc, warmup=False)))
        return got


class EagleCudaGraphManager(CudaGraphManager):
    """As vLLM 0.20-0.25 shape a draft capture: create_forward_fn(desc) builds once per descriptor, largest first,
    and that one build serves the warmup and the captured pass."""

    def capture(self, build, descs):
        got = []

        def create_forward_fn(desc):
            return build(desc.num_tokens)

        for desc in descs:
            got.append((desc.num_tokens, create_forward_fn(desc)))
        return got


def test_capture_pass_reads_the_descriptor_and_pass_from_the_stack():
    mgr = DraftCudaGraphManager()
    (row,) = mgr.capture(lambda n: capture_pass(sys._getframe(1)), [_Desc(8)])
    assert row == (8, (mgr, "FULL", True), (mgr, "FULL", False))
    assert capture_pass(sys._getframe()) is None  # no capture pass on this stack
    eagle = EagleCudaGraphManager()
    (row,) = eagle.capture(lambda n: capture_pass(sys._getframe(1)), [_Desc(8)])
    assert row == (8, (eagle, "FULL", None))  # one build for both passes (BOTH)

    class LoopCudaGraphManager(CudaGraphManager):  # a build in the capture loop itself, beside its `desc`
        def capture(self, build, descs):
            return [build(desc.num_tokens) for desc in descs]

    assert LoopCudaGraphManager().capture(lambda n: capture_pass(sys._getframe(1)), [_Desc(8)]) == [None]


def test_an_eagle_full_build_gets_the_metadata_built_first_for_both_passes():
    """0.20-0.25's shape (one build per descriptor): later FULL descriptors of the same manager get the first
    descriptor's metadata, counted as `both`; PIECEWISE keeps its own."""
    counters: dict = {}
    announced = []
    inj = StaleCaptureInjector(counters, announce=announced.append)
    builder = object()

    def build(n):
        return inj.reuse(builder, {"built_for": n}, capture_pass(sys._getframe(1)))

    managers = [EagleCudaGraphManager() for _ in range(2)]
    full = managers[0].capture(build, [_Desc(512), _Desc(8), _Desc(1)])
    assert [md["built_for"] for _, md in full] == [512, 512, 512]
    assert counters["inject_reused"] == {"both": 2}
    assert announced == [
        {
            "injection_wrote": "draft metadata reused",
            "source": "FULL warmup and captured passes: the first descriptor's metadata",
        }
    ]
    piecewise = managers[1].capture(build, [_Desc(512, "PIECEWISE"), _Desc(8, "PIECEWISE")])
    assert [md["built_for"] for _, md in piecewise] == [512, 8]


def test_a_draft_full_pass_gets_the_metadata_built_first_for_that_pass():
    """The object half of the defect (what 0.21.0-0.25.1 handed the draft's capture, what the 0.33.0 source mutant
    does): every later FULL pass of the same manager gets its first descriptor's metadata; PIECEWISE passes, other
    managers and builds no pass can be placed for keep their own."""
    counters: dict = {}
    announced = []
    inj = StaleCaptureInjector(counters, announce=announced.append)
    builder = object()

    def build(n):
        md = {"built_for": n}
        return inj.reuse(builder, md, capture_pass(sys._getframe(1)))

    managers = [DraftCudaGraphManager() for _ in range(3)]
    full = managers[0].capture(build, [_Desc(512), _Desc(8), _Desc(1)])
    assert [(n, w["built_for"], c["built_for"]) for n, w, c in full] == [(512, 512, 512), (8, 512, 512), (1, 512, 512)]
    assert full[1][1] is full[0][1] and full[1][2] is full[0][2]  # warmup and captured passes keep their own first
    assert full[0][1] is not full[0][2]
    assert counters["inject_reused"] == {"warmup": 2, "capture": 2}
    assert announced == [
        {"injection_wrote": "draft metadata reused", "source": "FULL warmup pass: the first descriptor's metadata"}
    ]
    assert inj.reached({}, full[0][1]) and not inj.reached({}, object())
    piecewise = managers[1].capture(build, [_Desc(512, "PIECEWISE"), _Desc(8, "PIECEWISE")])
    assert [w["built_for"] for _, w, _ in piecewise] == [512, 8]  # attention outside the graph: not the defect
    other = managers[2].capture(build, [_Desc(8)])
    assert other[0][1]["built_for"] == 8  # another manager (the draft's decode graphs): its own first build
    assert inj.reuse(builder, {"built_for": 3}, None) == {"built_for": 3}
    assert counters["inject_reuse_unplaced"] == 1


class _Metadata:
    """A metadata object (vLLM's are dataclasses: they take weak references)."""


class _Builder:
    pass


def test_metadata_born_at_an_injected_ones_address_in_the_same_pass_is_written_too():
    """The injector writes each metadata object of a pass once, known by its identity, not its id(): metadata created
    where the pass's injected one lived (after it died) gets its buffers written too."""
    counters: dict = {}
    inj = StaleCaptureInjector(counters)
    buf = _buffers()
    inj.target_built("t32r8", _build(buf, 8))
    newcomer = reborn(lambda: inj.inject(md := _Metadata(), _build(buf, 1), "draft build") and md, _Metadata)
    views = _build(buf, 1)  # rebuilt for the next metadata object, in the same pass (no new_pass between)
    assert inj.inject(newcomer, views, "draft warmup")
    assert counters["inject_writes"] == {"draft build": 1, "draft warmup": 1}
    assert buf["seq_lens"].tolist() == [108] * 8


def test_a_builder_born_at_a_dead_builders_address_gets_its_own_first_build():
    """The first FULL build of each pass is kept per builder by identity, not id(): a builder created where another
    lived (after it died) is handed its own metadata, never the dead builder's first build."""
    counters: dict = {}
    inj = StaleCaptureInjector(counters)
    mgr = DraftCudaGraphManager()

    def capture_with(builder, n):
        (row,) = mgr.capture(lambda k: inj.reuse(builder, {"built_for": k}, capture_pass(sys._getframe(1))), [_Desc(n)])
        return row

    newcomer = reborn(lambda: capture_with(b := _Builder(), 512) and b, _Builder)
    assert capture_with(newcomer, 8) == (8, {"built_for": 8}, {"built_for": 8})
    assert "inject_reused" not in counters
