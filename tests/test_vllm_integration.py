"""vLLM integration on CPU: the freshness auditor (core and plugin glue on a stand-in backend module), the source
check and `git bisect run` over a synthetic vLLM-like history, the overlay, the gate's model configs."""

import json
import subprocess
import sys
import types

import pytest
import torch

from repro.attention.builder import MetadataBuilder
from repro.case.descriptors import AttnConfig, BatchDescriptor
from repro.fa3_model.predict import ModelBackend
from repro.vllm_integration import plugin
from repro.vllm_integration.gate.worker import write_models
from repro.vllm_integration.plugin import backend_hooks, capture, counters
from repro.vllm_integration.plugin.audit import FreshnessAuditor
from repro.vllm_integration.releases.bisect import build_overlay, run_bisect, step
from repro.vllm_integration.releases.source_check import BAD, GOOD, UNTESTABLE, check_tree
from tests.fake_vllm import MANAGER_BAD, MANAGER_GOOD, FakeGraph, write_manager_history, write_manager_tree

CFG = AttnConfig()


def _views(md):
    return {"query_start_loc": md.query_start_loc, "seq_lens": md.seq_lens, "scheduler_metadata": md.scheduler_metadata}


def test_auditor_flags_views_overwritten_by_a_later_build():
    b = MetadataBuilder(ModelBackend("vllm"), CFG)
    aud = FreshnessAuditor()
    big = b.build(BatchDescriptor(32, 8, 4))
    aud.record_build(1, "t32r8", _views(big), {"num_reqs": 8, "max_query_len": 4, "max_seq_len": 4096})
    assert aud.check(1, _views(big)) == []  # nothing rebuilt yet
    b.build(BatchDescriptor(4, 1, 4))  # the target's last build overwrites the buffers
    found = aud.check(1, _views(big))
    assert {m.buffer for m in found} == {"query_start_loc", "seq_lens", "scheduler_metadata"}
    qsl = next(m for m in found if m.buffer == "query_start_loc")
    assert (qsl.index, qsl.built, qsl.now) == (2, 8, 4)
    md = next(m for m in found if m.buffer == "scheduler_metadata")
    assert md.field in ("prepare_seqlen_q", "num_splits_dynamic", "num_nheads_in_l2", "semaphore")
    assert "stale attention metadata for t32r8" in str(found[0]) and "stale fields" in aud.report()


def test_auditor_is_quiet_for_fresh_builds():
    b = MetadataBuilder(ModelBackend("vllm"), CFG)
    aud = FreshnessAuditor()
    for i, d in enumerate([BatchDescriptor(32, 8, 4), BatchDescriptor(4, 1, 4)]):
        md = b.build(d)
        aud.record_build(i, d.label, _views(md))
        assert aud.check(i, _views(md)) == []
    assert aud.check(99, {}) == [] and "every view held its own build" in aud.report()


def test_the_draft_loops_own_seq_lens_advance_is_not_staleness_another_descriptors_contents_are():
    """vLLM's eagle layout (0.20-0.22) advances seq_lens by one per draft step inside the draft decode graph, for the
    same batch (0.20.2 on the H200: "t512r512: seq_lens[0] is 2, the build wrote 1" in all 49 draft decode
    captures). That is told apart from another descriptor's contents: uniform +d, d within the bound, same length."""
    aud = FreshnessAuditor()
    built = {"seq_lens": torch.ones(4, dtype=torch.int32), "query_start_loc": torch.arange(5, dtype=torch.int32)}
    aud.record_build(1, "t4r4", built)
    advanced = {**built, "seq_lens": built["seq_lens"] + 2}
    assert aud.check(1, advanced, advance=8) == [] and aud.loop_advances == 1
    assert [m.buffer for m in aud.check(1, advanced)] == ["seq_lens"]  # outside a draft decode capture: stale
    assert [m.buffer for m in aud.check(1, advanced, advance=1)] == ["seq_lens"]  # beyond the bound
    other = {**built, "seq_lens": torch.tensor([7, 3, 1, 1], dtype=torch.int32)}  # another batch's lengths
    assert [m.buffer for m in aud.check(1, other, advance=8)] == ["seq_lens"]
    moved = {"seq_lens": built["seq_lens"] + 1, "query_start_loc": torch.arange(5, dtype=torch.int32) * 2}
    assert [m.buffer for m in aud.check(1, moved, advance=8)] == ["query_start_loc"]  # only seq_lens may advance
    back = {**built, "seq_lens": built["seq_lens"] - 1}
    assert [m.buffer for m in aud.check(1, back, advance=8)] == ["seq_lens"]  # the loop never goes back


def test_the_draft_loops_own_slot_mapping_beside_its_seq_lens_advance_is_not_staleness():
    """0.20.2 on the H200 (results/h200-release-table-2): besides seq_lens, the eagle draft loop recomputes
    slot_mapping from the advanced positions ("t512r512: slot_mapping[0] is 1, the build wrote -1": a padded row given
    a position; 21 -> 22 in two captures): AFFECTED for a release whose sources are good, until the auditor knew it.
    Slots are the loop's only with seq_lens advanced in the same check, and only moved by that step."""
    aud = FreshnessAuditor()
    built = {
        "seq_lens": torch.ones(4, dtype=torch.int32),
        "slot_mapping": torch.tensor([-1, 21, 15, -1], dtype=torch.int32),
        "query_start_loc": torch.arange(5, dtype=torch.int32),
    }
    aud.record_build(1, "t4r4", built)
    stepped = {**built, "seq_lens": built["seq_lens"] + 1, "slot_mapping": torch.tensor([1, 22, 32, -1])}
    assert aud.check(1, stepped, advance=8) == [] and aud.loop_advances == 2  # 15 -> 32: the next page, offset 0
    alone = {**built, "slot_mapping": torch.tensor([1, 22, 32, -1])}  # seq_lens as built: no loop step
    assert [m.buffer for m in aud.check(1, alone, advance=8)] == ["slot_mapping"]
    wrong = {**stepped, "slot_mapping": torch.tensor([1, 29, 16, -1])}  # 21 -> 29: not one step on
    assert [m.buffer for m in aud.check(1, wrong, advance=8)] == ["slot_mapping"]
    other = {**stepped, "slot_mapping": torch.tensor([1, 22, 16])}  # another batch's count of slots
    assert [m.buffer for m in aud.check(1, other, advance=8)] == ["slot_mapping"]
    assert [m.buffer for m in aud.check(1, stepped)] == ["seq_lens", "slot_mapping"]  # outside a draft decode capture


def test_plugin_wraps_a_backend_module(monkeypatch):
    """The glue, on a stand-in with the names vLLM's flash_attn module has."""
    bufs = {"query_start_loc": torch.zeros(5, dtype=torch.int32), "seq_lens": torch.zeros(4, dtype=torch.int32)}

    class Meta:
        def __init__(self, n):
            self.query_start_loc, self.seq_lens = bufs["query_start_loc"][: n + 1], bufs["seq_lens"][:n]
            self.scheduler_metadata, self.num_actual_tokens, self.max_query_len = None, 4 * n, 4

    class FlashAttentionMetadataBuilder:
        def build(self, n):
            bufs["query_start_loc"][: n + 1] = torch.arange(n + 1) * 4
            bufs["seq_lens"][:n] = 4
            bufs["seq_lens"][n:] = 0
            return Meta(n)

    class FlashAttentionImpl:
        def forward(self, layer, q, k, v, kv_cache, attn_metadata, output=None):
            return "ran"

    mod = types.SimpleNamespace(
        __name__="fake_flash_attn",
        FlashAttentionMetadataBuilder=FlashAttentionMetadataBuilder,
        FlashAttentionImpl=FlashAttentionImpl,
    )
    monkeypatch.setattr(counters, "AUDITOR", FreshnessAuditor())
    backend_hooks.install(mod)
    builder, impl = FlashAttentionMetadataBuilder(), FlashAttentionImpl()
    saved = builder.build(3)
    assert impl.forward(None, 0, 0, 0, None, saved) == "ran" and not counters.AUDITOR.mismatches
    builder.build(1)  # overwrites the persistent buffers
    impl.forward(None, 0, 0, 0, None, saved)
    assert counters.AUDITOR.mismatches and counters.AUDITOR.mismatches[0].descriptor == "t12r3"


def test_register_is_inert_unless_enabled(monkeypatch, capsys):
    for var in ("REPRO_AUDIT", "REPRO_REQUEST"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    before, graph = set(counters._installed), torch.cuda.graph
    plugin.register()  # must not import vllm or patch anything
    assert "vllm" not in sys.modules and counters._installed == before and torch.cuda.graph is graph
    printed = capsys.readouterr()
    assert printed.out == printed.err == ""


def test_register_announces_only_what_installed(monkeypatch, capsys):
    """A backend module without the hooked classes: an error line, and no `installed` line for the auditor."""
    fake = types.ModuleType("vllm.v1.attention.backends.flash_attn")
    for name in ("vllm", "vllm.v1", "vllm.v1.attention", "vllm.v1.attention.backends"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, fake.__name__, fake)
    monkeypatch.setattr(sys.modules["vllm.v1.attention.backends"], "flash_attn", fake, raising=False)
    monkeypatch.setattr(counters, "_installed", set())
    monkeypatch.setenv("REPRO_AUDIT", "1")  # a person's own vLLM run: the auditor alone (plugin.from_environment)
    monkeypatch.delenv("REPRO_REQUEST", raising=False)
    plugin.register()
    lines = [json.loads(x.split(" ", 1)[1]) for x in capsys.readouterr().out.splitlines() if x.startswith("REPRO_")]
    assert lines and all("error" in x for x in lines), lines
    assert "FlashAttentionImpl" in lines[0]["error"] and not counters._installed


def test_capture_kinds_come_from_the_vllm_objects_on_the_stack(monkeypatch):
    """torch.cuda.graph wrapped: each capture counted under the kind its manager, owner attribute and text say."""
    monkeypatch.setattr(counters, "COUNTERS", counters.new_counters())

    cuda = types.SimpleNamespace(graph=FakeGraph)
    capture.install_capture_tracker(cuda)

    class CudaGraphManager:
        def capture(self, progress_bar_desc):
            with cuda.graph():
                pass

    class PrefillSpeculatorCudaGraphManager(CudaGraphManager):
        pass

    class EagleSpeculator:
        def __init__(self):
            self.prefill_cudagraph_manager = PrefillSpeculatorCudaGraphManager()
            self.decode_cudagraph_manager = CudaGraphManager()

        def capture(self):
            self.prefill_cudagraph_manager.capture("Capturing prefill CUDA graphs")
            self.decode_cudagraph_manager.capture("Capturing CUDA graphs")

    class GPUModelRunner:
        def __init__(self):
            self.cudagraph_manager = CudaGraphManager()

        def capture_model(self):
            self.cudagraph_manager.capture("Capturing decode CUDA graphs (FULL)")
            EagleSpeculator().capture()

    GPUModelRunner().capture_model()
    with cuda.graph():  # nothing of vLLM's on the stack
        pass
    assert counters.COUNTERS["captures"] == {
        "target decode": 1, "draft prefill": 1, "draft decode": 1, capture.UNKNOWN_KIND: 1
    }  # fmt: skip
    assert counters.COUNTERS["runner"].endswith(".GPUModelRunner") and not counters.COUNTERS["captures_with_attention"]


@pytest.mark.parametrize("layout", ["autoregressive", "target_dependent_ar"])
def test_source_check_good_bad_and_layouts(tmp_path, layout):
    write_manager_tree(tmp_path / "bad", layout, MANAGER_BAD)
    write_manager_tree(tmp_path / "good", layout, MANAGER_GOOD)
    bad, good = check_tree(tmp_path / "bad"), check_tree(tmp_path / "good")
    assert bad.verdict == BAD and "PrefillSpeculatorCudaGraphManager.capture" in bad.reason and bad.layout == layout
    assert good.verdict == GOOD and good.layout == layout


def test_source_check_follows_the_call_sites(tmp_path):
    """A capture that takes saved states is bad only while some call hands it saved states (a fix may leave it dead)."""
    write_manager_tree(tmp_path, "autoregressive", MANAGER_BAD + MANAGER_GOOD)
    speculator = tmp_path / "vllm/v1/worker/gpu/spec_decode/autoregressive/speculator.py"
    speculator.write_text("def capture(self, attn_states):\n    self.prefill.capture(self._prefill, attn_states)\n")
    assert check_tree(tmp_path).verdict == BAD
    speculator.write_text("def capture(self):\n    self.prefill.capture(self._prefill, self.model_state)\n")
    v = check_tree(tmp_path)
    assert v.verdict == GOOD and any("never called with saved states" in e for e in v.evidence)


def test_source_check_untestable(tmp_path):
    assert check_tree(tmp_path).verdict == UNTESTABLE  # no vllm/
    write_manager_tree(tmp_path / "old", "autoregressive", None)
    v = check_tree(tmp_path / "old")
    assert v.verdict == UNTESTABLE and "no V2 model runner" in v.reason
    assert step(str(tmp_path / "old"), "source") == 125  # untestable
    write_manager_tree(tmp_path / "broken", "autoregressive", "def capture(:\n")
    assert check_tree(tmp_path / "broken").verdict == UNTESTABLE


def test_git_bisect_run_finds_the_commit_that_introduced_reuse(tmp_path):
    repo = tmp_path / "vllm-repo"
    shas = write_manager_history(
        repo,
        [MANAGER_GOOD + f"\n# {i}\n" for i in range(2)]
        + [MANAGER_BAD]
        + [MANAGER_BAD + f"\n# later {i}\n" for i in range(3)],
    )
    found = run_bisect(str(repo), "HEAD~5", "HEAD")
    assert (found.first, found.only_skipped) == (shas[2], False), found.log
    # the checkout is left as it was
    assert (
        subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        == shas[-1]
    )


def test_bisect_step_exit_codes_from_the_command_line(tmp_path):
    write_manager_tree(tmp_path / "bad", "autoregressive", MANAGER_BAD)
    write_manager_tree(tmp_path / "good", "autoregressive", MANAGER_GOOD)

    def run(p):
        cmd = [sys.executable, "-m", "repro.vllm_integration.releases.bisect", "step", "--repo", str(p)]
        return subprocess.run(cmd, capture_output=True, text=True).returncode

    assert (run(tmp_path / "good"), run(tmp_path / "bad"), run(tmp_path)) == (0, 1, 125)


def test_gate_step_maps_exit_codes(tmp_path):
    ok = [sys.executable, "-c", "raise SystemExit(0)"]
    bad = [sys.executable, "-c", "raise SystemExit(1)"]
    weird = [sys.executable, "-c", "raise SystemExit(7)"]
    assert [step(str(tmp_path), "gate", c) for c in (ok, bad, weird)] == [0, 1, 125]
    assert step(str(tmp_path), "gate", None) == 125


def test_overlay_combines_checkout_python_with_installed_extensions(tmp_path):
    write_manager_tree(tmp_path / "co", "autoregressive", MANAGER_GOOD)
    inst = tmp_path / "site" / "vllm"
    (inst / "vllm_flash_attn").mkdir(parents=True)
    (inst / "_C.abi3.so").write_bytes(b"\x7fELF")
    (inst / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").write_bytes(b"\x7fELF")
    (inst / "__init__.py").write_text("# installed, must not win")
    out = build_overlay(tmp_path / "co", inst, tmp_path / "ov")
    assert (out / "_C.abi3.so").is_symlink() and (out / "vllm_flash_attn" / "_vllm_fa3_C.abi3.so").exists()
    assert (out / "__init__.py").read_text() == ""  # the checkout's Python
    assert (out / "v1/worker/gpu/spec_decode/autoregressive/cudagraph_utils.py").exists()
    with pytest.raises(FileNotFoundError):
        build_overlay(tmp_path / "co", tmp_path / "nowhere", tmp_path / "ov2")


def test_gate_writes_local_target_and_eagle_configs(tmp_path):
    t, d = write_models(tmp_path)
    tc, dc = json.loads((t / "config.json").read_text()), json.loads((d / "config.json").read_text())
    assert tc["hidden_size"] // tc["num_attention_heads"] == tc["head_dim"] == 128
    assert dc["num_hidden_layers"] == 1 and dc["architectures"] == ["EagleLlamaForCausalLM"]
