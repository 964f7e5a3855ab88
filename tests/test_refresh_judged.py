"""The draft-decode refresh judged, never trusted (repro.vllm_integration.plugin.refresh), through a stand-in of FLASH_ATTN's
builder whose update_draft_decode_metadata recomputes FA3's scheduler metadata the way vLLM 0.34.0's does (from the
views' query_start_loc and seq_lens, through _get_scheduler_metadata, stored into the persistent buffer): a refresh
that computes for the previous draft step is stale (eager, and at the end of a capture it ran in), a correct one is
not; its self-control form (a step far ahead) and source mutant (the previous step) are caught by the same judging."""

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


_GARBAGE = [0]


def _leftover(n: int) -> list[int]:
    """What FA3's get_scheduler_metadata leaves in the entries it never writes (its tensor is torch::empty): whatever
    the allocation held, another value at every call (the GPU record: 0 in one, -1082114176 or 1077035062 in another)."""
    out = []
    for _ in range(n):
        _GARBAGE[0] += 1
        out.append((_GARBAGE[0] * 2654435761) % (1 << 31) - (1 << 30))
    return out


def _scheduler(batch_size: int, seqlens: torch.Tensor, cu_query_lens: torch.Tensor) -> torch.Tensor:
    """The stand-in of FA3's get_scheduler_metadata (vLLM's fork, num_splits > 1, causal): three vectors of
    round_up(b, 4) entries (prepare_seqlen_q: each request's query length; num_splits_dynamic: its KV blocks;
    num_nheads_in_l2), of which only the first b are written, then the tile-count semaphore. The entries past the
    batch and the semaphore hold leftovers (_leftover), as FA3's do."""
    b, br = batch_size, (batch_size + 3) // 4 * 4
    out = torch.tensor(_leftover(3 * br + 1), dtype=torch.int32)
    q = (cu_query_lens[1 : b + 1] - cu_query_lens[:b]).to(torch.int32)
    out[:b] = q
    out[br : br + b] = ((seqlens[:b] + BLOCK - 1) // BLOCK).to(torch.int32)
    out[2 * br : 2 * br + b] = 8
    return out


def standin_flash_attn(back: int = 0, with_get: bool = True, via_get: bool = False) -> types.ModuleType:
    """FLASH_ATTN's classes: build writes the persistent buffers (query_start_loc, seq_lens, scheduler_metadata) for n
    requests of q tokens; update_draft_decode_metadata recomputes the scheduler metadata from the views, as vLLM's
    does (a new tensor from _get_scheduler_metadata, copied into the builder's persistent buffer, the rest of it
    zeroed), for the step `back` steps before the one the views show (0: vLLM's; 1: the source mutant's)."""
    bufs = {
        "query_start_loc": torch.zeros(257, dtype=torch.int32),
        "seq_lens": torch.zeros(256, dtype=torch.int32),
        "scheduler_metadata": torch.zeros(1 + 256 * 4, dtype=torch.int32),
    }

    def _get_scheduler_metadata(self, *, aot_schedule, batch_size, cu_query_lens, max_query_len, seqlens, **_):
        return _scheduler(batch_size, seqlens, cu_query_lens)

    def _store_scheduler_metadata(self, sched):
        n = sched.shape[0]
        bufs["scheduler_metadata"][:n] = sched
        bufs["scheduler_metadata"][n:] = 0
        return bufs["scheduler_metadata"][:n]

    def build(self, common_prefix_len, n, seq=5, q=1):
        bufs["query_start_loc"][: n + 1] = torch.arange(n + 1) * q
        bufs["seq_lens"][:n] = torch.arange(seq, seq + n)
        md = types.SimpleNamespace(
            num_actual_tokens=n * q,
            max_query_len=q,
            max_seq_len=1024,
            causal=True,
            max_num_splits=32,
            num_decode_reqs=0,
            query_start_loc=bufs["query_start_loc"][: n + 1],
            seq_lens=bufs["seq_lens"][:n],
        )
        md.scheduler_metadata = self._store_scheduler_metadata(_scheduler(n, md.seq_lens, md.query_start_loc))
        return md

    def update_draft_decode_metadata(self, metadata):
        seq = metadata.seq_lens if not back else (metadata.seq_lens - back).clamp(min=0)
        n = metadata.num_decode_reqs or metadata.seq_lens.shape[0]
        if via_get:  # as vLLM 0.34.0's: through the builder's _get_scheduler_metadata, by keyword
            sched = self._get_scheduler_metadata(
                aot_schedule=True, batch_size=n, cu_query_lens=metadata.query_start_loc, max_query_len=1,
                seqlens=seq, max_seq_len=1024, causal=True, max_num_splits=32,
            )  # fmt: skip
        else:
            sched = _scheduler(n, seq, metadata.query_start_loc)
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


# the DFlash query captures a healthy vLLM 0.34.0 was called stale in on the H100 (results/h100-gate-default-cold:
# prepare_seqlen_q[r] of t<4r>r<r>, one entry past the batch): every request count that is no multiple of 4
GPU_FALSE_ALARMS = (62, 58, 54, 50, 46, 42, 38, 34, 30, 26, 22, 18, 14, 10, 6, 2, 1)


def _query_capture(plugin_state, builder, impl, n, seq):
    """DFlash's query graph (q = 4 a request): a FULL capture whose forward refreshes the metadata inside it."""
    md = builder.build(0, n, seq=seq, q=4)
    with plugin_state.graph():
        builder.update_draft_decode_metadata(md)
        impl.forward(None, 0, 0, 0, None, md)
    return md


@pytest.mark.parametrize("n", GPU_FALSE_ALARMS)
def test_a_correct_refresh_of_a_batch_no_multiple_of_4_is_clean_its_leftover_entries_not_judged(plugin_state, n):
    """FA3 writes the first n entries of each round_up(n, 4)-entry vector; the rest (and the semaphore) hold what its
    allocation left, another value at each call: the judging compares the batch's own entries only, and counts the
    others (neither clean nor stale). The old judging called this refresh stale at prepare_seqlen_q[n]."""
    mod, builder, impl = audited(plugin_state)
    md = _query_capture(plugin_state, builder, impl, n, seq=5)
    assert counters.AUDITOR.label_of(md) == f"t{4 * n}r{n}"
    assert stale_refresh_findings() == [] and counters.COUNTERS["refresh_stale"] == 0
    assert counters.COUNTERS["refresh_checks"] == 1 and counters.COUNTERS["refresh_unjudged"] == {}
    past = 3 * ((n + 3) // 4 * 4 - n) + 1  # each vector's entries past the batch, and the semaphore
    assert counters.COUNTERS["refresh_entries_unjudged"] == {"FLASH_ATTN.scheduler_metadata": past}


def test_the_leftover_entries_differ_between_two_correct_computations_as_on_the_gpu(plugin_state):
    """The stand-in's premise, as the GPU record shows it: two correct computations for the same step agree in the
    batch's entries and differ past it."""
    mod, builder, _impl = audited(plugin_state)
    md = builder.build(0, 62, seq=5, q=4)
    one = builder._get_scheduler_metadata(
        aot_schedule=True, batch_size=62, cu_query_lens=md.query_start_loc, max_query_len=4, seqlens=md.seq_lens
    )
    two = builder._get_scheduler_metadata(
        aot_schedule=True, batch_size=62, cu_query_lens=md.query_start_loc, max_query_len=4, seqlens=md.seq_lens
    )
    assert torch.equal(one[:62], two[:62]) and one[62] != two[62]


@pytest.mark.parametrize("n", (62, 6, 4))
def test_the_previous_step_refresh_is_still_stale_in_the_batchs_own_entries(plugin_state, n):
    """The source mutant refresh-previous-step in the GPU's shapes: inside the query capture and eagerly, its
    answer differs from the builder's in a request's own entry (a sequence crossing a KV block), found there."""
    mod, builder, impl = audited(plugin_state, back=1)
    _query_capture(plugin_state, builder, impl, n, seq=4)  # seq_lens 4.. : 4 -> 3 stays, 5 -> 4 crosses a block
    found = stale_refresh_findings()
    assert found and found[0].field == "num_splits_dynamic" and found[0].index < n
    assert found[0].descriptor == f"t{4 * n}r{n}" and found[0].built != found[0].now
    counters.AUDITOR.mismatches.clear()
    md = builder.build(0, n, seq=4, q=1)
    draft_steps(builder, impl, md, mod.bufs, n, steps=1)
    assert [m.index < n for m in stale_refresh_findings()] == [True]


def test_a_request_may_turn_the_judging_off_and_the_counters_say_so(plugin_state):
    """judge_refresh false: the mutant's refresh is not judged (each refreshed field counted unjudged), the eager one
    becomes the reference as before, and refresh_judging says why."""
    mod = standin_flash_attn(back=1)
    assert backend_hooks.install(mod, cuda=plugin_state, spec=BACKENDS["FLASH_ATTN"], judge_refresh=False)
    builder, impl = mod.FlashAttentionMetadataBuilder(), mod.FlashAttentionImpl()
    _query_capture(plugin_state, builder, impl, 6, seq=4)
    md = builder.build(0, 2, seq=4)
    draft_steps(builder, impl, md, mod.bufs, 2, steps=2)
    assert stale_refresh_findings() == [] and counters.COUNTERS["refresh_checks"] == 0
    assert counters.COUNTERS["refresh_unjudged"] == {"FLASH_ATTN.scheduler_metadata": 3}
    assert counters.COUNTERS["refresh_judging"] == refresh.OFF and counters.COUNTERS["draft_refreshes"] == 2


def test_the_judging_is_on_unless_asked_off(plugin_state):
    audited(plugin_state)
    assert counters.COUNTERS["refresh_judging"] == "on" and capture.judging_refresh()


def test_a_refresh_the_builder_cannot_judge_is_counted_not_trusted_silently(plugin_state):
    mod, builder, impl = audited(plugin_state, with_get=False)
    md = builder.build(0, 2)
    builder.update_draft_decode_metadata(md)  # a builder without vLLM's _get_scheduler_metadata: no answer to compare
    assert counters.COUNTERS["refresh_unjudged"] == {"FLASH_ATTN.scheduler_metadata": 1}
    assert counters.COUNTERS["refresh_checks"] == 0 and not counters.AUDITOR.mismatches


def test_the_self_control_form_stale_refresh_is_caught_by_the_judging(plugin_state):
    """inject=stale-refresh: a correct build's refresh written again for a step far ahead, eagerly and inside a
    capture (recorded there); the auditor's stale-refresh count catches it, the injection says it wrote and which
    captures it reached."""
    mod, builder, impl = audited(plugin_state)
    assert backend_hooks.install_inject(mod, cuda=plugin_state, spec=BACKENDS["FLASH_ATTN"], form=inject.STALE_REFRESH)
    assert isinstance(capture._INJECTOR["on"], refresh.StaleRefreshInjector)
    md = builder.build(0, 2, seq=4)
    draft_steps(builder, impl, md, mod.bufs, 2, steps=2)
    assert stale_refresh_findings() and all(m.index < 2 for m in stale_refresh_findings())  # the batch's own
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
    from repro.vllm_integration.gate.case import plan
    from repro.vllm_integration.gate.modes import GateMode
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


def test_a_judging_rule_that_raises_is_counted_unjudged_and_never_stops_vllms_loop(plugin_state, monkeypatch):
    """A build whose builder method takes other arguments than the rule passes: the refresh goes on, the field is
    unjudged with the exception's type (the gate cannot vouch for it), nothing is called stale."""

    def other_signature(builder, md, back):
        raise TypeError("_get_scheduler_metadata() got an unexpected keyword argument 'aot_schedule'")

    rule = refresh.REFRESHES["FLASH_ATTN"]["scheduler_metadata"]
    monkeypatch.setitem(
        refresh.REFRESHES["FLASH_ATTN"], "scheduler_metadata", refresh.Refresh(other_signature, rule.entries)
    )
    mod, builder, impl = audited(plugin_state)
    md = builder.build(0, 2, seq=3)
    draft_steps(builder, impl, md, mod.bufs, 2, steps=2)
    assert counters.COUNTERS["refresh_unjudged"] == {"FLASH_ATTN.scheduler_metadata: TypeError": 2}
    assert counters.COUNTERS["refresh_checks"] == 0 and not counters.AUDITOR.mismatches


def test_a_refresh_for_the_previous_step_is_stale_by_what_it_handed_fa3_even_where_its_answer_agrees(plugin_state):
    """On the H100 the refresh-previous-step mutant wrote what the builder gives at every judged refresh (no draft
    step of the gate's shapes crossed a block) and was not caught. What the refresh handed FA3's scheduler (seq_lens
    one less than its views show) is judged too: stale at the first eager refresh, within one block."""
    mod, builder, impl = audited(plugin_state, back=1, via_get=True)
    md = builder.build(0, 2, seq=6)  # 6,7 -> 5,6: the same blocks of 4, so FA3's answer is the builder's
    builder.update_draft_decode_metadata(md)
    found = stale_refresh_findings()
    assert not [m for m in found if m.buffer == "scheduler_metadata"]  # what it wrote agrees
    inputs = [m for m in found if m.buffer == "scheduler input"]
    assert inputs and inputs[0].field == "seqlens" and (inputs[0].built, inputs[0].now) == (6, 5)
    assert "seqlens[0] is 5, the builder gives 6 for the step its views show" in str(inputs[0])
    assert counters.COUNTERS["refresh_stale"] == 1  # one refresh, counted once
    assert builder._get_scheduler_metadata.__func__ is type(builder)._get_scheduler_metadata  # given back


def test_a_correct_refresh_passes_its_own_views_and_its_inputs_agree(plugin_state):
    mod, builder, impl = audited(plugin_state, via_get=True)
    md = builder.build(0, 3, seq=3)
    draft_steps(builder, impl, md, mod.bufs, 3, steps=3)
    assert stale_refresh_findings() == []
    assert counters.COUNTERS["refresh_input_checks"] == 6  # seqlens and cu_query_lens at each of 3 refreshes
    assert counters.COUNTERS["refresh_stale"] == 0


def test_inside_a_capture_a_refresh_that_hands_fa3_another_tensor_is_named_unjudged_and_nothing_copied(plugin_state):
    """In a capture nothing can be read (the fixture fails a host copy while a graph is open): the refresh-previous-step
    mutant's seq_lens - 1, a tensor the graph computes, is named in refresh_unjudged; the view it passed as
    cu_query_lens is judged by identity. The shadow is given back."""
    mod, builder, impl = audited(plugin_state, back=1, via_get=True)
    md = builder.build(0, 2, seq=5)
    capture._AUDIT_ON["on"] = True
    with plugin_state.graph():
        builder.update_draft_decode_metadata(md)
        assert "_get_scheduler_metadata" not in vars(builder)
    assert counters.COUNTERS["refresh_unjudged"] == {"FLASH_ATTN.input seqlens in a capture: not the step's view": 1}
    assert counters.COUNTERS["refresh_input_checks"] == 1  # cu_query_lens: the step's own view
    assert stale_refresh_findings() == []  # nothing claimed stale from what could not be read


def test_inside_a_capture_a_refresh_that_hands_fa3_its_own_views_is_judged_by_identity(plugin_state):
    mod, builder, impl = audited(plugin_state, via_get=True)
    md = builder.build(0, 3, seq=5)
    capture._AUDIT_ON["on"] = True
    with plugin_state.graph():
        builder.update_draft_decode_metadata(md)
    assert counters.COUNTERS["refresh_input_checks"] == 2
    assert not counters.COUNTERS.get("refresh_unjudged")


def test_a_slice_of_the_view_reads_its_memory_and_a_copy_does_not():
    seq = torch.arange(8, dtype=torch.int32)
    assert refresh.same_memory(seq, seq) and refresh.same_memory(seq[:3], seq)
    assert not refresh.same_memory(seq.clone(), seq) and not refresh.same_memory(seq[1:], seq)
    assert not refresh.same_memory(seq.long(), seq) and not refresh.same_memory(None, seq)
