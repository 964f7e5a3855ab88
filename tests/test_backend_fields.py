"""The freshness auditor on every attention backend it has a table for, on CPU: stand-in backend modules shaped like
each recorded vLLM release's real classes (results/vllm-versions.json: class names, metadata tensor fields, which
builder methods exist), FlashInfer's wrapper buffers, generic discovery, the in-graph draft-decode refresh (vLLM 0.28
on), and that nothing is copied to the host while a graph is captured."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from repro.contract import request
from repro.vllm_integration import plugin
from repro.vllm_integration.plugin import audit, backend_fields, backend_hooks, capture, counters, metadata_views
from repro.vllm_integration.plugin.audit import FreshnessAuditor
from repro.vllm_integration.plugin.backend_fields import BACKENDS, FLASHINFER, TRITON_ATTN, find_classes, generic
from repro.vllm_integration.releases.versions import load
from tests.capture_standin import GraphStandIn
from tests.case_requests import case_request, plugin_request

RECORD = load()


@pytest.fixture
def fresh_plugin(monkeypatch):
    """The plugin's state made new where its hooks read it (repro.vllm_integration.plugin.counters and .capture)."""
    monkeypatch.setattr(counters, "AUDITOR", FreshnessAuditor())
    monkeypatch.setattr(counters, "COUNTERS", counters.new_counters())
    monkeypatch.setattr(capture, "_CAPTURES", [])
    return plugin


def _set(obj, path: str, value) -> None:
    *parents, last = path.split(".")
    for p in parents:
        if not hasattr(obj, p):
            setattr(obj, p, types.SimpleNamespace())
        obj = getattr(obj, p)
    setattr(obj, last, value)


def standin_backend(name: str, facts: dict) -> tuple[types.ModuleType, dict]:
    """A backend module with a recorded release's names: <X>MetadataBuilder.build writes every recorded tensor field
    into a persistent buffer (contents that differ per batch size) and hands out views; build_for_cudagraph_capture
    (where recorded) fills seq_lens with 1 after build, as TRITON_ATTN's does; update_draft_decode_metadata (where
    recorded) rewrites the scheduler metadata in place, as FLASH_ATTN's does."""
    spec = BACKENDS[name]
    bufs = {f: torch.zeros(9, dtype=torch.int32) for f in facts["metadata_tensor_fields"]}

    def build(self, common_prefix_len, n):
        md = types.SimpleNamespace(num_actual_tokens=4 * n, num_decodes=n, num_prefills=0)  # FlashInfer's counts
        for i, (f, buf) in enumerate(bufs.items()):
            buf[: n + 1] = torch.arange(n + 1) * (n + 1) + i
            buf[n + 1 :] = 0
            _set(md, f, buf[: n + 1])
        return md

    methods = {"build": build}
    if facts["build_for_cudagraph_capture"]:

        def build_for_cudagraph_capture(self, n):
            md = self.build(0, n)
            if getattr(md, "seq_lens", None) is not None:
                md.seq_lens.fill_(1)
            return md

        methods["build_for_cudagraph_capture"] = build_for_cudagraph_capture
    if facts["update_draft_decode_metadata"]:

        def update_draft_decode_metadata(self, metadata):
            if getattr(metadata, "scheduler_metadata", None) is not None:
                metadata.scheduler_metadata += 1

        methods["update_draft_decode_metadata"] = update_draft_decode_metadata

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return "ran"

    mod = types.ModuleType(spec.module)
    setattr(mod, spec.builder, type(spec.builder, (), methods))
    setattr(mod, spec.impl, type(spec.impl, (), {"forward": forward}))
    return mod, bufs


CASES = [(r["version"], name) for r in RECORD for name in BACKENDS]


@pytest.mark.parametrize(("version", "name"), CASES, ids=[f"{v}-{n}" for v, n in CASES])
def test_the_auditor_on_a_standin_of_each_recorded_release_and_backend(fresh_plugin, version, name):
    """A build overwritten by a later build is stale in every field the table checks and in none it excludes; a
    fresh build is clean; build_for_cudagraph_capture's own rewrite is not stale; forwards count per backend."""
    facts = next(r for r in RECORD if r["version"] == version)["backends"][name]
    spec = BACKENDS[name]
    mod, bufs = standin_backend(name, facts)
    assert backend_hooks.install(mod, spec=spec)
    builder, impl = getattr(mod, spec.builder)(), getattr(mod, spec.impl)()
    md = builder.build(0, 3)
    assert impl.forward(None, 0, 0, 0, None, md) == "ran" and not counters.AUDITOR.mismatches
    if facts["build_for_cudagraph_capture"]:
        captured = builder.build_for_cudagraph_capture(2)
        impl.forward(None, 0, 0, 0, None, captured)
        assert not counters.AUDITOR.mismatches, "build_for_cudagraph_capture's own rewrite reported stale"
    builder.build(0, 1)  # the target's last build overwrites every persistent buffer
    impl.forward(None, 0, 0, 0, None, md)
    stale = {m.buffer for m in counters.AUDITOR.mismatches}
    excluded = {f for f in bufs if spec.excluded_reason(f)}
    assert stale == set(bufs) - excluded and all(m.descriptor == "t12r3" for m in counters.AUDITOR.mismatches)
    assert counters.COUNTERS["backends"] == {name: 3 if facts["build_for_cudagraph_capture"] else 2}
    assert set(counters.COUNTERS["fields_not_checked"].get(name, {})) == excluded
    wrapped = getattr(getattr(mod, spec.builder), "update_draft_decode_metadata", None)
    assert (wrapped is not None and wrapped._repro_wrapped) == facts["update_draft_decode_metadata"]


def test_every_recorded_metadata_field_is_in_its_backends_table():
    """Every tensor field the recorded releases' metadata classes declare is checked or excluded by name."""
    missing = {
        (r["version"], name, f)
        for r in RECORD
        for name, facts in r["backends"].items()
        for f in facts["metadata_tensor_fields"]
        if not BACKENDS[name].listed(f)
    }
    assert not missing, f"add these to repro/vllm_integration/plugin/backend_fields.py: {sorted(missing)}"


def test_flashinfer_wrapper_buffers_are_checked_and_its_workspace_is_not(fresh_plugin):
    """FlashInfer's decode wrapper under CUDA graphs holds views of the builder's persistent index buffers: a later
    plan for another batch makes them stale; its workspaces are excluded, and said so in the counters."""
    indptr = torch.zeros(9, dtype=torch.int32)

    class BatchDecodeWithPagedKVCacheWrapper:
        def __init__(self, n):
            self._paged_kv_indptr_buf = indptr[: n + 1]
            self._int_workspace_buffer = torch.zeros(16, dtype=torch.uint8)

    class FIDecode:
        def __init__(self, wrapper):
            self.wrapper = wrapper

    class FlashInferMetadataBuilder:
        def build(self, common_prefix_len, n):
            indptr[: n + 1] = torch.arange(n + 1) * 7
            indptr[n + 1 :] = 0
            md = types.SimpleNamespace(num_decodes=n, num_prefills=0, num_actual_tokens=n, causal=True)
            md.decode = FIDecode(BatchDecodeWithPagedKVCacheWrapper(n))
            md.decode.wrapper._int_workspace_buffer.fill_(n)
            return md

    class FlashInferImpl:
        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
            return None

    mod = types.SimpleNamespace(
        __name__=FLASHINFER.module, FlashInferMetadataBuilder=FlashInferMetadataBuilder, FlashInferImpl=FlashInferImpl
    )
    assert backend_hooks.install(mod, spec=FLASHINFER)
    b = FlashInferMetadataBuilder()
    md = b.build(0, 4)
    b.build(0, 2)
    FlashInferImpl().forward(None, 0, 0, 0, None, md)
    assert {m.buffer for m in counters.AUDITOR.mismatches} == {"decode.wrapper._paged_kv_indptr_buf"}
    assert counters.AUDITOR.mismatches[0].descriptor == "t4r4"
    assert "decode.wrapper._int_workspace_buffer" in counters.COUNTERS["fields_not_checked"]["FLASHINFER"]


def test_a_tensor_no_table_lists_is_checked_and_reported_as_unlisted(fresh_plugin):
    md = types.SimpleNamespace(query_start_loc=torch.arange(3), brand_new_field=torch.ones(2))
    views = metadata_views.views_of(md, TRITON_ATTN)
    assert set(views) == {"query_start_loc", "brand_new_field"}
    assert counters.COUNTERS["fields_unlisted"] == {"TRITON_ATTN": ["brand_new_field"]}


def test_generic_discovery_and_missing_classes(fresh_plugin, capsys):
    """A backend without a table: the one *MetadataBuilder and *Impl of its module; none or two is an error line
    and nothing installed."""

    def fwd(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return None

    mod = types.ModuleType("vllm.v1.attention.backends.some_attn")
    builder = type("SomeAttnMetadataBuilder", (), {"build": lambda self, n: None, "__module__": mod.__name__})
    impl = type("SomeAttnImpl", (), {"forward": fwd, "__module__": mod.__name__})
    mod.SomeAttnMetadataBuilder, mod.SomeAttnImpl = builder, impl
    spec = generic("SOME_ATTN", mod.__name__)
    assert find_classes(mod, spec) == (builder, impl)
    mod.OtherMetadataBuilder = type("OtherMetadataBuilder", (), {"build": lambda s: 0, "__module__": mod.__name__})
    with pytest.raises(LookupError, match="expected one \\*MetadataBuilder"):
        find_classes(mod, spec)
    assert backend_hooks.install(types.ModuleType(TRITON_ATTN.module), spec=TRITON_ATTN) is False
    err = capsys.readouterr().out
    assert "REPRO_PLUGIN" in err and "TritonAttentionMetadataBuilder/TritonAttentionImpl not found" in err


def test_forward_must_take_attn_metadata_where_vllm_passes_it(fresh_plugin, capsys):
    mod = types.ModuleType(TRITON_ATTN.module)
    mod.TritonAttentionMetadataBuilder = type("TritonAttentionMetadataBuilder", (), {"build": lambda s, n: None})
    mod.TritonAttentionImpl = type("TritonAttentionImpl", (), {"forward": lambda self, layer, md: None})
    assert backend_hooks.install(mod, spec=TRITON_ATTN) is False
    assert "forward does not take attn_metadata" in capsys.readouterr().out


# --- the in-graph draft-decode refresh (vLLM 0.28 on) ---------------------------------------------------------------


@pytest.fixture
def draft_loop(fresh_plugin, monkeypatch):
    """FLASH_ATTN's stand-in with update_draft_decode_metadata, the capture tracker on a stand-in torch.cuda, and
    host copies forbidden while a capture is open."""
    facts = {
        "metadata_tensor_fields": ["query_start_loc", "scheduler_metadata", "seq_lens", "slot_mapping"],
        "build_for_cudagraph_capture": False,
        "update_draft_decode_metadata": True,
    }
    mod, bufs = standin_backend("FLASH_ATTN", facts)
    cuda = types.SimpleNamespace(graph=GraphStandIn)
    assert backend_hooks.install(mod, cuda=cuda, spec=BACKENDS["FLASH_ATTN"])
    real = audit._ints

    def no_copy_in_capture(v):
        assert not GraphStandIn.open, "copied a view to the host while a graph was being captured"
        return real(v)

    monkeypatch.setattr(audit, "_ints", no_copy_in_capture)
    return mod.FlashAttentionMetadataBuilder(), mod.FlashAttentionImpl(), bufs, cuda


def _advance(bufs, n):
    """What the speculator does between draft steps: seq_lens + 1, slot mappings recomputed, in place."""
    bufs["seq_lens"][:n] += 1
    bufs["slot_mapping"][:n] += 1


def test_an_eager_refresh_is_the_new_reference(draft_loop):
    builder, impl, bufs, _ = draft_loop
    md = builder.build(0, 2)
    impl.forward(None, 0, 0, 0, None, md)
    _advance(bufs, 2)
    builder.update_draft_decode_metadata(md)
    impl.forward(None, 0, 0, 0, None, md)  # step 2 of the fused draft loop, eager
    assert not counters.AUDITOR.mismatches and counters.COUNTERS["draft_refreshes"] == 1
    _advance(bufs, 2)  # advanced again, but not refreshed: what the forward sees is not what was recorded
    impl.forward(None, 0, 0, 0, None, md)
    assert {m.buffer for m in counters.AUDITOR.mismatches} == {"seq_lens", "slot_mapping"}


def test_a_refresh_inside_a_capture_makes_its_fields_the_graphs(draft_loop):
    """Inside a capture: nothing is copied to the host; the refreshed fields are not compared at the capture's end;
    a field the refresh does not rewrite (query_start_loc) still is; builds inside the capture are counted."""
    builder, impl, bufs, cuda = draft_loop
    md = builder.build(0, 2)
    with cuda.graph():
        impl.forward(None, 0, 0, 0, None, md)
        builder.update_draft_decode_metadata(md)
        _advance(bufs, 2)  # stands for what the graph will do at replay
        impl.forward(None, 0, 0, 0, None, md)
        assert builder.build(0, 2) is not None
    assert not counters.AUDITOR.mismatches
    assert counters.COUNTERS["draft_refreshes_in_graph"] == 1 and counters.COUNTERS["builds_in_graph"] == 1
    assert counters.COUNTERS["captures_refreshed_in_graph"] == {capture.UNKNOWN_KIND: 1}
    md = builder.build(0, 3)
    with cuda.graph():
        impl.forward(None, 0, 0, 0, None, md)
        builder.update_draft_decode_metadata(md)
        bufs["query_start_loc"][1] = 99  # not a field the refresh rewrites: still checked
    assert {m.buffer for m in counters.AUDITOR.mismatches} == {"query_start_loc"}


def test_a_dflash_query_graph_skips_only_the_scheduler_metadata_its_refresh_rewrites(draft_loop, monkeypatch):
    """DFlash's query graph refreshes scheduler_metadata in the graph but runs no draft loop: seq_lens and
    slot_mapping that moved inside it are stale, not the loop's step; a draft decode graph's are its loop's."""
    builder, impl, bufs, cuda = draft_loop

    def capture_as(kind):
        monkeypatch.setattr(capture, "graph_kind", lambda frame: kind)
        counters.AUDITOR.mismatches.clear()
        md = builder.build(0, 2)
        with cuda.graph():
            impl.forward(None, 0, 0, 0, None, md)
            builder.update_draft_decode_metadata(md)
            bufs["scheduler_metadata"][0] += 7  # the refresh's recomputation, the graph's to compute
            _advance(bufs, 2)
        return {m.buffer for m in counters.AUDITOR.mismatches}

    assert capture_as("draft query") == {"seq_lens", "slot_mapping"}
    assert counters.COUNTERS["captures_stale"] == {"draft query": 1}
    assert capture_as("draft decode") == set()


def test_without_a_refresh_a_capture_still_reports_stale_views(draft_loop):
    builder, impl, bufs, cuda = draft_loop
    md = builder.build(0, 3)
    builder.build(0, 1)
    with cuda.graph():
        impl.forward(None, 0, 0, 0, None, md)
    assert {m.buffer for m in counters.AUDITOR.mismatches} == {
        "query_start_loc",
        "scheduler_metadata",
        "seq_lens",
        "slot_mapping",
    }
    assert counters.COUNTERS["captures_stale"] == {capture.UNKNOWN_KIND: 1}


# --- which backend, which layout ------------------------------------------------------------------------------------


def test_the_backend_comes_from_the_environment():
    def asked(env):
        return plugin.requested(plugin.from_environment(env))["attention_backend"]

    assert asked({"REPRO_AUDIT": "1"}) == backend_fields.DEFAULT_BACKEND
    assert asked({"REPRO_AUDIT": "1", "REPRO_ATTENTION_BACKEND": "TRITON_ATTN"}) == "TRITON_ATTN"
    triton = case_request(plugin_request(attention_backend="TRITON_ATTN"))
    assert asked({request.ENV: triton.to_json()}) == "TRITON_ATTN"  # a gate case's request
    with pytest.raises(ValueError, match="attention_backend"):
        asked({"REPRO_AUDIT": "1", "REPRO_ATTENTION_BACKEND": "triton; rm"})


def test_register_hooks_the_backend_named_and_says_when_it_cannot(monkeypatch, capsys, fresh_plugin):
    facts = {"metadata_tensor_fields": ["seq_lens"], "build_for_cudagraph_capture": True}
    mod, _ = standin_backend("TRITON_ATTN", {**facts, "update_draft_decode_metadata": False})
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(counters, "_installed", set())
    monkeypatch.setattr(capture, "install_capture_tracker", lambda cuda: None)
    monkeypatch.setattr(counters, "at_exit", lambda f: None)
    monkeypatch.delenv("REPRO_WEIGHTS", raising=False)
    monkeypatch.setenv("REPRO_AUDIT", "1")
    monkeypatch.setenv("REPRO_ATTENTION_BACKEND", "TRITON_ATTN")
    plugin.register()
    out = capsys.readouterr().out
    assert '"installed": "audit", "backend": "TRITON_ATTN"' in out and "error" not in out
    assert counters.COUNTERS["spec_layout"] is None and counters.COUNTERS["spec_layout_known"] is False
    monkeypatch.setattr(counters, "_installed", set())
    monkeypatch.setenv("REPRO_ATTENTION_BACKEND", "NO_SUCH_BACKEND")
    plugin.register()
    out = capsys.readouterr().out
    assert "cannot import vLLM's attention backend NO_SUCH_BACKEND" in out and "installed" not in out


@pytest.mark.parametrize("layout", ["autoregressive", "target_dependent_ar", "eagle", "some_future_layout"])
def test_the_spec_decode_layout_is_read_from_the_files(tmp_path, layout):
    (tmp_path / "vllm/v1/worker/gpu/spec_decode" / layout).mkdir(parents=True)
    found, known = plugin.spec_layout_of(tmp_path)
    if layout == "some_future_layout":
        assert (found, known) == (None, False)  # no layout source_check knows: cannot vouch
    else:
        assert found == layout and known == (layout in plugin.KNOWN_SPEC_LAYOUTS)


def test_every_recorded_layout_is_one_the_plugin_knows():
    assert {r["layout"] for r in RECORD} == set(plugin.KNOWN_SPEC_LAYOUTS)


def test_gate_takes_every_backend_vllm_names_so():
    from repro.vllm_integration.gate.modes import parse_backends
    from repro.vllm_integration.plugin.backend_fields import known_name

    names = "FLASH_ATTN,triton_attn,FLASHINFER,FLEX_ATTENTION,TREE_ATTN,CUTLASS_MLA,ROCM_AITER_UNIFIED_ATTN"
    assert parse_backends(names)[:2] == ("FLASH_ATTN", "TRITON_ATTN")
    assert not any(known_name(n) for n in ("BOGUS_BACKEND", "ATTN", "FLASH", "FLASH_ATTN_", "_ATTN", "FLASH__ATTN"))
