"""The self control's injector (repro.vllm_integration.inject) on real tensors: what a target capture build leaves
is written into a draft capture's buffers, only the defect's fields, once per pass, never while a graph records;
capture_role reads the call stack as vLLM's managers shape it; FA3's never-written entries get the fill."""

from __future__ import annotations

import sys

import torch

from repro.layout import VLLM, metadata_layout
from repro.vllm_integration.inject import StaleCaptureInjector, capture_role


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
