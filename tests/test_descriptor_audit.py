"""The auditor's descriptor check and the self control's second form, on a CPU stand-in shaped as vLLM 0.34.0's V2
runner is (vllm/v1/worker/gpu/cudagraph_utils.py, spec_decode/autoregressive/cudagraph_utils.py,
spec_decode/dflash/cudagraph.py, attention/backends/flash_attn.py): a CudaGraphManager whose capture loop runs
create_forward_fn(desc, warmup) for each BatchExecutionDescriptor, an eager warmup forward, then the captured pass
inside torch.cuda.graph; prepare_inputs_to_capture writing make_dummy's contents into persistent buffers and calling
the builder's build(common_prefix_len, common_attn_metadata), which copies FA3's scheduler metadata into its own
persistent buffer and hands out views.

What it guarantees: a build for the WRONG descriptor of the same capture list, consistent in itself, is caught as
stale-descriptor (and not by the contents check, which it passes); every right build passes with the check counted
as fired in every capture manager (target, speculator prefill and decode, DFlash); a check that cannot run is
counted as such (the gate cannot vouch), never clean; the self control's second form is caught by the same check."""

from __future__ import annotations

import types
from dataclasses import dataclass

import pytest
import torch

from repro.backends.layout import VLLM, metadata_layout
from repro.vllm_integration.plugin import backend_hooks, capture, counters
from repro.vllm_integration.plugin.audit import (
    STALE_CONTENTS,
    STALE_DESCRIPTOR,
    CaptureDescriptor,
    FreshnessAuditor,
    descriptor_mismatches,
)
from repro.vllm_integration.plugin.inject import STALE_CAPTURE
from repro.vllm_integration.plugin.inject import STALE_DESCRIPTOR as FORM_2
from tests.fake_vllm import FakeGraph
from tests.reused_address import reborn


class _Mode:
    def __init__(self, name: str):
        self.name = name


FULL, NONE = _Mode("FULL"), _Mode("NONE")
MAX_REQS = 8


@dataclass(frozen=True)
class BatchExecutionDescriptor:
    cg_mode: _Mode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    max_query_len: int | None = None
    num_active_loras: int = 0
    num_ubatches: int = 1


@dataclass(frozen=True)
class SpeculatorBatchDescriptor(BatchExecutionDescriptor):
    num_speculative_tokens: int = 0


def _sched_size(n: int) -> int:
    return metadata_layout(VLLM, n, 1, True, False).size


BUF = {
    "query_start_loc": torch.zeros(MAX_REQS * 4 + 1, dtype=torch.int32),
    "seq_lens": torch.zeros(MAX_REQS * 4, dtype=torch.int32),
    "slot_mapping": torch.zeros(64, dtype=torch.int64),
    "block_table": torch.zeros(MAX_REQS * 4, 4, dtype=torch.int32),
    "scheduler_metadata": torch.zeros(_sched_size(32) + 8, dtype=torch.int32),
}


@dataclass
class CommonAttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    block_table_tensor: torch.Tensor
    slot_mapping: torch.Tensor


@dataclass
class FlashAttentionMetadata:
    num_actual_tokens: int
    max_query_len: int
    query_start_loc: torch.Tensor
    max_seq_len: int
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    scheduler_metadata: torch.Tensor | None = None
    causal: bool = True


def _backend() -> types.SimpleNamespace:
    """Fresh classes each time: the plugin wraps a class once."""

    class FlashAttentionMetadataBuilder:
        headdim = 128

        def build(self, common_prefix_len, common_attn_metadata, fast_build=False):
            cm = common_attn_metadata
            n = _sched_size(cm.num_reqs)
            BUF["scheduler_metadata"][:n] = cm.num_reqs * 100 + cm.max_query_len  # FA3's plan for this batch
            BUF["scheduler_metadata"][n:] = 0
            return FlashAttentionMetadata(
                cm.num_actual_tokens, cm.max_query_len, cm.query_start_loc, 1024, cm.seq_lens,
                cm.block_table_tensor, cm.slot_mapping, BUF["scheduler_metadata"][:n],
            )  # fmt: skip

    class FlashAttentionImpl:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
            return None

    return types.SimpleNamespace(
        __name__="fake_flash_attn",
        FlashAttentionMetadataBuilder=FlashAttentionMetadataBuilder,
        FlashAttentionImpl=FlashAttentionImpl,
    )


def prepare_inputs_to_capture(num_reqs, num_tokens, builder, max_query_len=None):
    """vLLM's: InputBatch.make_dummy into the persistent buffers, dummy slots, then the builder."""
    base, extra = divmod(num_tokens, num_reqs)
    lens = torch.full((num_reqs,), base, dtype=torch.int32)
    if extra:
        lens[-extra:] += 1
    BUF["seq_lens"][:num_reqs], BUF["seq_lens"][num_reqs:] = lens, 0
    BUF["query_start_loc"][0] = 0
    BUF["query_start_loc"][1 : num_reqs + 1] = torch.cumsum(lens, 0)
    BUF["query_start_loc"][num_reqs + 1 :] = num_tokens
    BUF["slot_mapping"].fill_(-1)
    BUF["slot_mapping"][:num_tokens] = torch.arange(num_tokens)
    cm = CommonAttentionMetadata(
        BUF["query_start_loc"][: num_reqs + 1], BUF["seq_lens"][:num_reqs], num_reqs, num_tokens,
        max_query_len or num_tokens, BUF["block_table"][:num_reqs], BUF["slot_mapping"][:num_tokens],
    )  # fmt: skip
    return builder.build(0, cm)


CUDA = types.SimpleNamespace(graph=FakeGraph)


class CudaGraphManager:
    """vLLM's capture loop: FULL descriptors largest first, a warmup pass and a captured pass each."""

    def __init__(self, descs):
        self.descs, self.max_num_reqs = descs, MAX_REQS

    def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        for desc in self.descs:
            forward_fn = create_forward_fn(desc, warmup=True)
            forward_fn(NONE)
            forward_fn = create_forward_fn(desc, warmup=False)
            with CUDA.graph(object()):
                forward_fn(NONE)


class SpeculatorCudaGraphManager(CudaGraphManager):
    """spec_decode/autoregressive/cudagraph_utils.py; `wrong`: a mutant that builds each descriptor's metadata for
    the next descriptor of the same capture list (consistently: object and buffers from one build)."""

    def capture(self, forward_fn, builder, wrong=False, progress_bar_desc="Capturing CUDA graphs"):
        def create_forward_fn(desc, warmup):
            d = self.descs[(self.descs.index(desc) + 1) % len(self.descs)] if wrong else desc
            md = prepare_inputs_to_capture(d.num_reqs, d.num_tokens, builder, d.max_query_len or d.uniform_token_count)
            return lambda cg_mode: forward_fn(md)

        super().capture(create_forward_fn, progress_bar_desc)


class DFlashCudaGraphManager(CudaGraphManager):
    """spec_decode/dflash/cudagraph.py: its own _prepare_dflash_inputs_to_capture (max_query_len num_tokens //
    num_reqs)."""

    def capture(self, forward_fn, builder, progress_bar_desc="Capturing CUDA graphs"):
        def create_forward_fn(desc, warmup):
            num_reqs = desc.num_reqs or min(desc.num_tokens, self.max_num_reqs)
            md = prepare_inputs_to_capture(num_reqs, desc.num_tokens, builder, desc.num_tokens // num_reqs)
            return lambda cg_mode: forward_fn(md)

        super().capture(create_forward_fn, progress_bar_desc)


def _uniform(q, sizes, cls=BatchExecutionDescriptor, **kw):
    return [cls(FULL, n * q, n, uniform_token_count=q, **kw) for n in sizes]


class Runner:
    """The target's capture (uniform decode, 1 + k tokens a request), then the speculator's draft prefill and draft
    decode managers and a DFlash manager."""

    def __init__(self, mod, wrong=False):
        self.builder, self.impl, self.wrong = mod.FlashAttentionMetadataBuilder(), mod.FlashAttentionImpl(), wrong
        self.cudagraph_manager = CudaGraphManager(_uniform(4, (8, 4, 1)))

    def forward(self, md):
        self.impl.forward(None, None, None, None, None, md)

    def capture_model(self):
        def create(desc, warmup):
            md = prepare_inputs_to_capture(desc.num_reqs, desc.num_tokens, self.builder, desc.uniform_token_count)
            return lambda cg_mode: self.forward(md)

        self.cudagraph_manager.capture(create, "Capturing CUDA graphs (decode, FULL)")
        EagleSpeculator(self).capture()


class EagleSpeculator:
    def __init__(self, runner):
        self.runner = runner
        self.prefill_cudagraph_manager = SpeculatorCudaGraphManager(_uniform(4, (8, 2, 1)))
        self.decode_cudagraph_manager = SpeculatorCudaGraphManager(
            _uniform(1, (8, 4, 1), SpeculatorBatchDescriptor, num_speculative_tokens=3)
        )
        self.query_cudagraph_manager = DFlashCudaGraphManager(_uniform(4, (4, 1)))

    def capture(self):
        r = self.runner
        self.prefill_cudagraph_manager.capture(r.forward, r.builder, r.wrong, "Capturing prefill CUDA graphs")
        self.decode_cudagraph_manager.capture(r.forward, r.builder, False, "Capturing decode CUDA graphs")
        self.query_cudagraph_manager.capture(r.forward, r.builder, "Capturing CUDA graphs")


@pytest.fixture
def plugin_state(monkeypatch):
    monkeypatch.setattr(counters, "COUNTERS", counters.new_counters())
    monkeypatch.setattr(counters, "AUDITOR", FreshnessAuditor())
    monkeypatch.setattr(counters, "_installed", set())
    monkeypatch.setattr(capture, "_AUDIT_ON", {"on": False})
    monkeypatch.setattr(capture, "_INJECTOR", {})
    monkeypatch.setattr(CUDA, "graph", FakeGraph)
    return counters


def _audited(inject: str | None = None, wrong: bool = False):
    mod = _backend()
    assert backend_hooks.install(mod, CUDA)
    if inject:
        assert backend_hooks.install_inject(mod, CUDA, form=inject)
    Runner(mod, wrong).capture_model()
    kinds = {m.kind for m in counters.AUDITOR.mismatches}
    return counters.COUNTERS, kinds


def test_every_right_build_passes_with_the_check_counted_in_every_capture_manager(plugin_state):
    c, kinds = _audited()
    assert kinds == set() and not c["descriptor_unchecked"]
    # target decode: 3 descriptors x (warmup forward + capture end); draft prefill 3, draft decode 3, DFlash 2 (its
    # manager runs under the speculator: a draft capture of its own kind)
    assert c["descriptor_checks"] == {
        "target decode": 6,
        "draft prefill": 6,
        "draft decode": 6,
        "draft query": 4,
    }
    assert counters.AUDITOR.descriptor_checks == 22 and not c["descriptor_stale"]


def test_a_consistent_build_for_another_descriptor_is_stale_descriptor_not_stale_contents(plugin_state):
    """The descriptor mutant: each draft prefill descriptor's metadata built, consistently, for the next one of
    the same capture list. The contents check passes it (every view holds what its own build wrote); the descriptor
    check does not."""
    c, kinds = _audited(wrong=True)
    assert kinds == {STALE_DESCRIPTOR}
    assert c["descriptor_stale"] == {"draft prefill": 6} and not c["descriptor_unchecked"]
    first = counters.AUDITOR.mismatches[0]
    assert first.descriptor == "FULL t32r8 q4" and (first.buffer, first.built, first.now) == (
        "num_actual_tokens",
        32,
        8,
    )
    assert "built for another descriptor while capturing FULL t32r8 q4" in str(first)


def test_the_second_self_control_form_is_caught_by_the_descriptor_check_alone(plugin_state):
    c, kinds = _audited(inject=FORM_2)
    assert kinds == {STALE_DESCRIPTOR}  # object and buffers consistent: the contents check sees nothing
    # every draft manager (prefill, decode, DFlash's), every FULL descriptor but the first (largest) of each
    assert c["inject_rebuilt"] == {"warmup": 5, "capture": 5}
    # captures that read buffers the injection wrote: every draft capture after its first write, no target capture
    assert c["captures_injected"] == {"draft prefill": 2, "draft decode": 3, "draft query": 2}
    assert c["descriptor_stale"] == {"draft prefill": 4, "draft decode": 4, "draft query": 2}
    assert not c["descriptor_unchecked"] and not c.get("captures_stale", {}).get("target decode")


def test_the_first_self_control_form_is_caught_too(plugin_state):
    c, kinds = _audited(inject=STALE_CAPTURE)
    assert STALE_CONTENTS in kinds and c["captures_injected"]


def test_a_descriptor_the_check_cannot_read_is_counted_unchecked_never_clean(plugin_state):
    mod = _backend()
    assert backend_hooks.install(mod, CUDA)
    builder, impl = mod.FlashAttentionMetadataBuilder(), mod.FlashAttentionImpl()

    @dataclass(frozen=True)
    class Odd:  # a FULL descriptor without a token count
        cg_mode: _Mode

    def create(desc, warmup):
        md = prepare_inputs_to_capture(2, 8, builder, 4)
        return lambda cg_mode: impl.forward(None, None, None, None, None, md)

    CudaGraphManager([Odd(FULL)]).capture(create)
    unbuilt = FlashAttentionMetadata(8, 4, BUF["query_start_loc"][:3], 1024, BUF["seq_lens"][:2], None, None)
    CudaGraphManager(_uniform(4, (2,))).capture(lambda d, warmup: lambda m: impl.forward(0, 0, 0, 0, 0, unbuilt))
    unchecked = counters.COUNTERS["descriptor_unchecked"]
    assert any("without a token count" in k for k in unchecked)
    assert any("no build of the metadata in use was recorded" in k for k in unchecked)
    assert not counters.COUNTERS["descriptor_checks"] and not counters.AUDITOR.mismatches


def test_metadata_born_at_a_dead_builds_address_is_not_checked_against_that_build(plugin_state):
    """The auditor keeps a build's record by its metadata object's identity, not its id(): metadata created where a
    recorded build's object lived (after it died) is no build the auditor knows (counted unchecked: cannot vouch),
    never checked, and passed, against the dead one's record."""
    mod = _backend()
    assert backend_hooks.install(mod, CUDA)
    builder, impl = mod.FlashAttentionMetadataBuilder(), mod.FlashAttentionImpl()
    qsl, seq_lens = BUF["query_start_loc"][:3], BUF["seq_lens"][:2]
    recorded = lambda: prepare_inputs_to_capture(2, 8, builder, 4)  # noqa: E731 (a build for FULL t8r2 q4, recorded)
    unbuilt = reborn(recorded, lambda: FlashAttentionMetadata(8, 4, qsl, 1024, seq_lens, None, None))
    CudaGraphManager(_uniform(4, (2,))).capture(lambda d, warmup: lambda m: impl.forward(0, 0, 0, 0, 0, unbuilt))
    unchecked = counters.COUNTERS["descriptor_unchecked"]
    assert any("no build of the metadata in use was recorded" in k for k in unchecked)
    assert not counters.COUNTERS["descriptor_checks"]


def test_outside_a_full_capture_pass_nothing_is_checked_or_counted(plugin_state):
    mod = _backend()
    assert backend_hooks.install(mod, CUDA)
    builder, impl = mod.FlashAttentionMetadataBuilder(), mod.FlashAttentionImpl()
    impl.forward(None, None, None, None, None, prepare_inputs_to_capture(2, 8, builder, 4))  # a runtime step
    piecewise = BatchExecutionDescriptor(_Mode("PIECEWISE"), 8, None)
    CudaGraphManager([piecewise]).capture(
        lambda d, warmup: lambda m: impl.forward(0, 0, 0, 0, 0, prepare_inputs_to_capture(2, 8, builder))
    )
    c = counters.COUNTERS
    assert not c["descriptor_checks"] and not c["descriptor_unchecked"] and counters.AUDITOR.checks


@pytest.mark.parametrize(
    "fields, views, wrong",
    [
        ({"num_actual_tokens": 16, "num_reqs": 4, "max_query_len": 4}, {"query_start_loc": [0, 4, 8, 12, 16]}, []),
        ({"num_actual_tokens": 32}, {}, ["num_actual_tokens"]),
        ({"max_query_len": 1}, {}, ["max_query_len"]),
        ({}, {"query_start_loc": [0, 4, 8]}, ["query_start_loc"]),  # two requests, not four
        ({}, {"query_start_loc": [0, 4, 8, 12, 15]}, ["query_start_loc"]),  # ends at 15 tokens, not 16
        ({}, {"query_start_loc": [0, 2, 8, 12, 16]}, ["query_start_loc"]),  # not uniform
        ({}, {"seq_lens": [4, 4], "slot_mapping": list(range(16))}, ["seq_lens"]),
        ({}, {"slot_mapping": list(range(8))}, ["slot_mapping"]),
    ],
)
def test_what_the_builder_gives_for_a_descriptor(fields, views, wrong):
    desc = CaptureDescriptor("FULL", 16, 4, 4, uniform=True, spec_tokens=3)
    found, compared = descriptor_mismatches(desc, fields, views)
    assert [m.buffer for m in found] == wrong and compared and all(m.kind == STALE_DESCRIPTOR for m in found)
    assert desc.label == "FULL t16r4 q4 k3"


def test_a_mixed_descriptor_bounds_each_request_by_its_query_length():
    desc = CaptureDescriptor("FULL", 10, 4, 4)  # max_query_len 4, not uniform: 2, 2, 3, 3 is vLLM's split
    assert descriptor_mismatches(desc, {}, {"query_start_loc": [0, 2, 4, 7, 10]}) == ([], ["query_start_loc"])
    assert descriptor_mismatches(desc, {}, {"query_start_loc": [0, 1, 2, 3, 10]})[0]  # 7 tokens in one request
