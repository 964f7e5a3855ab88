"""The draft-decode refresh judged, never trusted (repro.vllm_integration.plugin.refresh), through a stand-in of FLASH_ATTN's
builder whose update_draft_decode_metadata recomputes FA3's scheduler metadata the way vLLM 0.34.0's does (from the
views' query_start_loc and seq_lens, through _get_scheduler_metadata, stored into the persistent buffer): a refresh
that computes for the previous draft step is stale (eager, and at the end of a capture it ran in), a correct one is
not; its self-control form and source mutant are caught by the same judging."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from repro.vllm_integration.plugin import audit, backend_hooks, capture, counters, inject, refresh
from repro.vllm_integration.plugin.audit import STALE_REFRESH, FreshnessAuditor, Mismatch, in_words
from repro.vllm_integration.plugin.backend_fields import BACKENDS, FLASH_ATTN
from tests.capture_standin import GraphStandIn

ROOT = Path(__file__).resolve().parent.parent
BLOCK = 4  # the stand-in's KV block: a scheduler-metadata entry changes when a sequence crosses a multiple of it


def _scheduler(batch_size: int, seqlens: torch.Tensor) -> torch.Tensor:
    """The stand-in of FA3's get_scheduler_metadata: per request its KV blocks, then the batch size (the stand-in's
    refresh calls it directly, so a builder without _get_scheduler_metadata still refreshes)."""
    blocks = (seqlens[:batch_size] + BLOCK - 1) // BLOCK
    return torch.cat([blocks.to(torch.int32), torch.tensor([batch_size], dtype=torch.int32)])


def standin_flash_attn(back: int = 0, with_get: bool = True) -> types.ModuleType:
    """FLASH_ATTN's classes: build writes the persistent buffers (query_start_loc, seq_lens, scheduler_metadata) for n
    requests of one token; update_draft_decode_metadata recomputes the scheduler metadata from the views, as vLLM's
    does, for the step `back` steps before the one the views show (0: vLLM's; 1: the source mutant's)."""
    bufs = {
        "query_start_loc": torch.zeros(9, dtype=torch.int32),
        "seq_lens": torch.zeros(8, dtype=torch.int32),
        "scheduler_metadata": torch.zeros(16, dtype=torch.int32),
    }

    def _get_scheduler_metadata(self, *, aot_schedule, batch_size, cu_query_lens, max_query_len, seqlens, **_):
        return _scheduler(batch_size, seqlens)

    def _store_scheduler_metadata(self, sched):
        n = sched.shape[0]
        bufs["scheduler_metadata"][:n] = sched
        bufs["scheduler_metadata"][n:] = 0
        return bufs["scheduler_metadata"][:n]

    def build(self, common_prefix_len, n, seq=5):
        bufs["query_start_loc"][: n + 1] = torch.arange(n + 1)
        bufs["seq_lens"][:n] = torch.arange(seq, seq + n)
        md = types.SimpleNamespace(
            num_actual_tokens=n,
            max_query_len=1,
            max_seq_len=64,
            causal=True,
            max_num_splits=0,
            num_decode_reqs=0,
            query_start_loc=bufs["query_start_loc"][: n + 1],
            seq_lens=bufs["seq_lens"][:n],
        )
        md.scheduler_metadata = self._store_scheduler_metadata(_scheduler(n, md.seq_lens))
        return md

    def update_draft_decode_metadata(self, metadata):
        seq = metadata.seq_lens if not back else (metadata.seq_lens - back).clamp(min=0)
        sched = _scheduler(metadata.num_decode_reqs or metadata.seq_lens.shape[0], seq)
        metadata.scheduler_metadata = self._store_scheduler_metadata(sched)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return "ran"

    methods = {"build": build, "update_draft_decode_metadata": update_draft_decode_metadata}
    methods["_store_scheduler_metadata"] = _store_scheduler_metadata
    if with_get:
        methods["_get_scheduler_metadata"] = _get_scheduler_metadata
    mod = types.ModuleType(FLASH_ATTN.module)
    mod.FlashAttentionMetadataBuilder = type("FlashAttentionMetadataBuilder", (), methods)
    mod.FlashAttentionImpl = type("FlashAttentionImpl", (), {"forward": forward})
    mod.bufs = bufs
    return mod


@pytest.fixture
def plugin_state(monkeypatch):
    monkeypatch.setattr(counters, "AUDITOR", FreshnessAuditor())
    monkeypatch.setattr(counters, "COUNTERS", counters.new_counters())
    monkeypatch.setattr(capture, "_CAPTURES", [])
    monkeypatch.setattr(capture, "_AUDIT_ON", {"on": False})
    monkeypatch.setattr(capture, "_INJECTOR", {})
    real = audit._ints

    def no_copy_in_capture(v):
        assert not GraphStandIn.open, "copied a view to the host while a graph was being captured"
        return real(v)

    monkeypatch.setattr(audit, "_ints", no_copy_in_capture)
    monkeypatch.setattr(refresh, "_ints", no_copy_in_capture)
    return types.SimpleNamespace(graph=GraphStandIn)


def audited(cuda, **standin):
    mod = standin_flash_attn(**standin)
    assert backend_hooks.install(mod, cuda=cuda, spec=BACKENDS["FLASH_ATTN"])
    return mod, mod.FlashAttentionMetadataBuilder(), mod.FlashAttentionImpl()


def draft_steps(builder, impl, md, bufs, n, steps=3):
    """The fused draft loop, eager: before each step the refresh, then the step's forward, then seq_lens + 1."""
    for _ in range(steps):
        builder.update_draft_decode_metadata(md)
        impl.forward(None, 0, 0, 0, None, md)
        bufs["seq_lens"][:n] += 1


def stale_refresh_findings():
    return [m for m in counters.AUDITOR.mismatches if m.kind == STALE_REFRESH]


def test_a_refresh_for_the_step_its_views_show_is_judged_and_agrees(plugin_state):
    mod, builder, impl = audited(plugin_state)
    md = builder.build(0, 2, seq=3)
    draft_steps(builder, impl, md, mod.bufs, 2, steps=4)  # seq_lens 3,4 -> 6,7: blocks change on the way
    assert counters.AUDITOR.mismatches == []
    assert counters.COUNTERS["refresh_checks"] == 4 and counters.AUDITOR.refresh_checks == 4
    assert counters.COUNTERS["draft_refreshes"] == 4 and counters.COUNTERS["refresh_unjudged"] == {}


def test_an_eager_refresh_computed_for_the_previous_step_is_stale_refresh(plugin_state, capsys):
    """The source mutant's refresh (seq_lens one less): the auditor once took it as the new reference; now the step
    where the previous step's answer differs (a sequence crossing a block) is stale-refresh, naming the field."""
    mod, builder, impl = audited(plugin_state, back=1)
    md = builder.build(0, 2, seq=3)  # 3 -> 2 is the same block; 4 -> 3 and 5 -> 4 cross one
    draft_steps(builder, impl, md, mod.bufs, 2, steps=3)
    found = stale_refresh_findings()
    assert found and {m.buffer for m in found} == {"scheduler_metadata"}
    assert counters.COUNTERS["refresh_stale"] >= 1
    first = found[0]
    assert first.built != first.now and first.descriptor == "t2r2"
    assert "computed for another step or batch" in str(first)
    assert '"kind": "stale-refresh"' in capsys.readouterr().out  # the channel's AUDIT line


def test_a_refresh_inside_a_capture_is_judged_at_the_captures_end(plugin_state):
    """Inside a capture nothing is copied; at its end the refreshed scheduler metadata is compared with the builder's
    answer for the views as they are: the mutant's is stale, vLLM's is not (no longer left out as the graph's)."""
    for back, stale in ((0, False), (1, True)):
        counters.AUDITOR.mismatches.clear()
        capture._AUDIT_ON["on"] = False
        mod, builder, impl = audited(plugin_state, back=back)
        md = builder.build(0, 2, seq=4)  # 4 -> 3 crosses a block: the previous step's answer differs
        with plugin_state.graph():
            impl.forward(None, 0, 0, 0, None, md)
            builder.update_draft_decode_metadata(md)
            impl.forward(None, 0, 0, 0, None, md)
        assert bool(stale_refresh_findings()) is stale, back
        assert counters.COUNTERS["draft_refreshes_in_graph"] >= 1


def test_a_refresh_the_builder_cannot_judge_is_counted_not_trusted_silently(plugin_state):
    mod, builder, impl = audited(plugin_state, with_get=False)
    md = builder.build(0, 2)
    builder.update_draft_decode_metadata(md)  # a builder without vLLM's _get_scheduler_metadata: no answer to compare
    assert counters.COUNTERS["refresh_unjudged"] == {"FLASH_ATTN.scheduler_metadata": 1}
    assert counters.COUNTERS["refresh_checks"] == 0 and not counters.AUDITOR.mismatches


def test_the_self_control_form_stale_refresh_is_caught_by_the_judging(plugin_state):
    """inject=stale-refresh: a correct build's refresh written again for the previous step, eagerly and inside a
    capture (recorded there); the auditor's stale-refresh count catches it, the injection says it wrote and which
    captures it reached."""
    mod, builder, impl = audited(plugin_state)
    assert backend_hooks.install_inject(mod, cuda=plugin_state, spec=BACKENDS["FLASH_ATTN"], form=inject.STALE_REFRESH)
    assert isinstance(capture._INJECTOR["on"], refresh.StaleRefreshInjector)
    md = builder.build(0, 2, seq=4)
    draft_steps(builder, impl, md, mod.bufs, 2, steps=2)
    assert stale_refresh_findings()
    assert counters.COUNTERS["inject_writes"]["draft refresh"] == 2
    assert counters.COUNTERS["inject_refresh_changed"] >= 1
    md = builder.build(0, 2, seq=4)
    with plugin_state.graph():  # the fused loop: the refresh, then the step's forward
        builder.update_draft_decode_metadata(md)
        impl.forward(None, 0, 0, 0, None, md)
    assert counters.COUNTERS["captures_injected"] == {capture.UNKNOWN_KIND: 1}


def test_the_gates_default_forms_are_unchanged_and_a_request_may_ask_for_stale_refresh():
    from repro.vllm_integration import plugin

    assert inject.STALE_REFRESH not in inject.INJECTIONS and inject.STALE_REFRESH in inject.ALL_INJECTIONS
    with pytest.raises(ValueError, match="stale-refresh"):
        plugin.requested(_request(inject="no-such"))
    assert plugin.requested(_request(inject=inject.STALE_REFRESH))["inject"] == inject.STALE_REFRESH


def _request(**over):
    from tests.case_requests import plugin_request

    return plugin_request(**over)


def test_a_stale_refresh_record_reads_in_words():
    m = Mismatch("t2r2", "scheduler_metadata", "num_n_blocks", 1, 2, 1, STALE_REFRESH)
    assert in_words(m.to_dict()) == str(m)
    assert "num_n_blocks[1] is 1, the builder gives 2" in str(m)


def _mutate_vllm():
    spec = importlib.util.spec_from_file_location("mutate_vllm", ROOT / "scripts" / "mutate_vllm.py")
    mod = sys.modules.setdefault("mutate_vllm", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(mod)
    return mod


def test_the_refresh_mutant_patches_the_refresh_alone(tmp_path):
    """The mutant's anchor is the refresh's call (its seqlens argument), which vLLM 0.34.0's flash_attn.py holds once;
    the build's own call (seqlens=seq_lens) is untouched."""
    mv = _mutate_vllm()
    mutant = mv.MUTANTS["refresh-previous-step"]
    src = tmp_path / "src"
    text = (
        "class FlashAttentionMetadataBuilder:\n    def build(self):\n        self._get_scheduler_metadata(\n"
        "            seqlens=seq_lens,\n        )\n\n    def update_draft_decode_metadata(self, metadata):\n"
        "        scheduler_metadata = self._get_scheduler_metadata(\n" + mutant.anchor + "        )\n"
    )
    for rel, body in {"vllm/__init__.py": "\n", mutant.file: text}.items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_text(body)
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "mutate_vllm.py"),
            str(src),
            str(tmp_path / "d"),
            "--mutant",
            mutant.name,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    after = (tmp_path / "d" / mutant.file).read_text()
    assert "seqlens=(metadata.seq_lens - 1).clamp(min=0)," in after and "seqlens=seq_lens," in after
    assert (src / mutant.file).read_text() == text


def test_the_gate_runs_the_stale_refresh_form_when_asked_and_refuses_an_unknown_form():
    import argparse

    from repro.vllm_integration.gate import methods
    from repro.vllm_integration.gate.modes import GateMode
    from repro.vllm_integration.gate.run import plan
    from repro.vllm_integration.releases.builds import VllmBuild

    parser = argparse.ArgumentParser()
    methods.add_option(parser)
    a = parser.parse_args(["--self-control-forms", "stale-capture,stale-refresh"])
    assert a.forms == (inject.STALE_CAPTURE, inject.STALE_REFRESH)
    assert parser.parse_args([]).forms == inject.INJECTIONS  # the gate's default forms are unchanged
    with pytest.raises(SystemExit):
        parser.parse_args(["--self-control-forms", "stale-nothing"])
    cases = plan([VllmBuild("0.34.0", None)], (GateMode("audit"),), 1, 60.0, forms=a.forms)
    assert "stale_metadata-vllm-0.34.0-self-control-stale-refresh-audit" in {c.case_id for c in cases}


@pytest.fixture(autouse=True)
def _asked_for(monkeypatch):
    """The check is off by default (a false alarm on a healthy 0.34.0): these tests turn it on."""
    from repro.vllm_integration.plugin import refresh  # noqa: PLC0415  the module whose switch the test turns

    monkeypatch.setattr(refresh, "JUDGED", True)
