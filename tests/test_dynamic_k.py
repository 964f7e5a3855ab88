"""Dynamic speculative decoding (vLLM 0.34.0's num_speculative_tokens_per_batch_size): the descriptor check keyed by K
and the self control's form stale-k, on test_descriptor_audit's CPU stand-in of the V2 runner with the draft decode
manager K-specialized as SpeculatorCudaGraphManager.capture(specialize_spec_tokens=True) makes it (one FULL descriptor
per (batch shape, K), largest K first); and the gate's dynamic-K methods: their speculative_config, their ids, where
they are not applicable and why, and their own self control."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.errors import ConfigError
from repro.vllm_integration.gate import dynamic_k as gate_dynamic_k
from repro.vllm_integration.gate import methods
from repro.vllm_integration.plugin import backend_hooks, counters
from repro.vllm_integration.plugin.audit import STALE_DESCRIPTOR
from repro.vllm_integration.plugin.inject import STALE_CAPTURE, STALE_K
from tests import test_descriptor_audit as sd
from tests.test_descriptor_audit import FULL, SpeculatorBatchDescriptor

plugin_state = sd.plugin_state  # the same fixture: fresh counters, auditor and injector
K_SCHEDULE = (3, 2)


class DynamicKSpeculator(sd.EagleSpeculator):
    """The draft decode manager's descriptors as specialize_spec_tokens makes them: each batch shape once per K."""

    def __init__(self, runner):
        super().__init__(runner)
        self.decode_cudagraph_manager = sd.SpeculatorCudaGraphManager(
            [
                SpeculatorBatchDescriptor(FULL, n, n, uniform_token_count=1, num_speculative_tokens=k)
                for n in (8, 4, 1)
                for k in K_SCHEDULE
            ]
        )


class DynamicKRunner(sd.Runner):
    def capture_model(self):
        def create(desc, warmup):
            md = sd.prepare_inputs_to_capture(desc.num_reqs, desc.num_tokens, self.builder, desc.uniform_token_count)
            return lambda cg_mode: self.forward(md)

        self.cudagraph_manager.capture(create, "Capturing CUDA graphs (decode, FULL)")
        DynamicKSpeculator(self).capture()


def audited(inject: str | None = None):
    mod = sd._backend()
    assert backend_hooks.install(mod, sd.CUDA)
    if inject:
        assert backend_hooks.install_inject(mod, sd.CUDA, form=inject)
    DynamicKRunner(mod).capture_model()
    return counters.COUNTERS, counters.AUDITOR.mismatches


def test_every_k_specialized_graph_is_checked_and_counted_by_its_k(plugin_state):
    c, found = audited()
    assert found == [] and not c["descriptor_unchecked"]
    # 3 batch shapes per K, each a warmup forward and a capture end
    assert c["descriptor_checks_by_k"] == {"3": 6, "2": 6}
    assert c["descriptor_checks"]["draft decode"] == 12


def test_a_k_specialized_capture_fed_another_ks_metadata_is_stale_descriptor(plugin_state):
    """The form stale-k: the K=2 pass of each batch shape gets the metadata built for K=3 (same shape: the contents
    and the other descriptor fields agree); only the K-keyed check sees it, by the auditor's own count."""
    c, found = audited(STALE_K)
    assert {m.kind for m in found} == {STALE_DESCRIPTOR}
    assert {(m.buffer, m.built, m.now) for m in found} == {("num_speculative_tokens", 2, 3)}
    assert c["descriptor_stale"] == {"draft decode": 6}  # 3 shapes x (warmup forward, capture end)
    assert c["inject_other_k"] == {"warmup": 3, "capture": 3}
    assert c["captures_injected"] == {"draft decode": 3}
    assert "built for another descriptor while capturing FULL t8r8 q1 k2" in str(found[0])


def test_without_a_k_in_the_descriptor_stale_k_changes_nothing(plugin_state):
    """A build without dynamic speculative decoding (one K, no K-specialized descriptors): the form has nothing to
    hand over, and says so by its count (no control there: the gate runs it for its dynamic-K methods only)."""
    mod = sd._backend()
    assert backend_hooks.install(mod, sd.CUDA)
    assert backend_hooks.install_inject(mod, sd.CUDA, form=STALE_K)
    sd.Runner(mod).capture_model()
    assert not counters.COUNTERS.get("inject_other_k") and not counters.AUDITOR.mismatches


# --- the gate's dynamic-K methods ----------------------------------------------------------------------------------


def test_each_autoregressive_method_has_a_dynamic_k_variant_with_its_schedule():
    for base in gate_dynamic_k.BASES:
        name = gate_dynamic_k.name_of(base)
        spec = methods.TABLE[name]
        cfg = spec.speculative_config(Path("d") if spec.draft else None, 3)
        assert cfg["method"] == base and cfg["num_speculative_tokens"] == 3
        assert cfg["num_speculative_tokens_per_batch_size"] == [list(e) for e in gate_dynamic_k.SCHEDULE]
        assert spec.models() == methods.TABLE[base].models()  # the base method's pair and reference models
    assert "num_speculative_tokens_per_batch_size" not in methods.TABLE[methods.EAGLE].speculative_config(None, 3)


def test_the_schedule_gives_two_ks_of_at_least_two_within_the_gates_k():
    ks = {k for _a, _b, k in gate_dynamic_k.SCHEDULE}
    assert len(ks) == 2 and min(ks) >= 2 and max(ks) <= 3  # vLLM captures a graph for every K but 0 and 1
    assert gate_dynamic_k.SCHEDULE[0][0] == 1  # vLLM requires the first range to start at batch size 1


def test_dynamic_k_case_ids_are_readable_and_get_the_stale_k_self_control():
    from repro.vllm_integration.gate.case import GateCase
    from repro.vllm_integration.gate.modes import GateMode
    from repro.vllm_integration.gate.run import plan
    from repro.vllm_integration.releases.builds import VllmBuild

    build = VllmBuild(label="0.34.0", prefix=None)
    cases = plan([build], (GateMode("audit"),), 1, 60.0, methods=("eagle", "eagle_dynamic_k"))
    ids = {c.case_id for c in cases}
    assert "stale_metadata-vllm-0.34.0-self-control-stale-k-eagle-dynamic-k-audit" in ids
    assert "stale_metadata-vllm-0.34.0-under-test-eagle-dynamic-k-audit" in ids
    assert not any("stale-k" in i for i in ids if "dynamic-k" not in i)  # the form only where K is dynamic
    assert isinstance(cases[0], GateCase)


def test_dflash_has_no_dynamic_k_and_is_refused_with_its_reason():
    with pytest.raises(ConfigError, match="dflash_dynamic_k: DFlash drafts a block"):
        methods.parse_methods("dflash_dynamic_k")
    assert methods.parse_methods("eagle_dynamic_k,eagle") == ("eagle_dynamic_k", "eagle")


def _tree(root: Path, schedule: bool = True, specialize: bool = True, speculator: str = "EagleSpeculator") -> Path:
    """A vLLM package's files as the applicability check reads them (0.34.0's names)."""
    spec = root / "v1" / "worker" / "gpu" / "spec_decode"
    files = {
        spec / "speculator_config.py": 'TABLE = {"eagle": ("eagle.config", "EagleSpeculatorConfig")}\n',
        spec / "eagle" / "config.py": "class EagleSpeculatorConfig:\n"
        f'    speculator_class = "vllm.v1.worker.gpu.spec_decode.eagle.speculator.{speculator}"\n',
        spec / "eagle" / "speculator.py": "from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import "
        "AutoRegressiveSpeculator\nclass EagleSpeculator(AutoRegressiveSpeculator):\n    pass\n"
        "class OtherSpeculator:\n    def capture(self):\n        self.graph()\n",
        spec / "autoregressive" / "speculator.py": "class AutoRegressiveSpeculator:\n    def capture(self):\n"
        "        self.graph()\n",
        spec / "autoregressive" / "cudagraph_utils.py": "def specialize_spec_tokens(): ...\n" if specialize else "\n",
        root / "config" / "speculative.py": "num_speculative_tokens_per_batch_size = None\n" if schedule else "\n",
    }
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_a_dynamic_k_method_is_not_applicable_with_the_reason_where_the_build_lacks_it(tmp_path):
    name = gate_dynamic_k.name_of(methods.EAGLE)
    assert methods.not_applicable(_tree(tmp_path / "ok"), name) is None
    assert "num_speculative_tokens_per_batch_size" in methods.not_applicable(
        _tree(tmp_path / "a", schedule=False), name
    )
    assert "specialize_spec_tokens" in methods.not_applicable(_tree(tmp_path / "b", specialize=False), name)
    why = methods.not_applicable(_tree(tmp_path / "c", speculator="OtherSpeculator"), name)
    assert "not an autoregressive speculator" in why and "OtherSpeculator" in why


def test_the_stale_k_form_is_a_request_the_plugin_takes():
    from repro.vllm_integration import plugin
    from tests.case_requests import plugin_request

    assert plugin.requested(plugin_request(inject=STALE_K))["inject"] == STALE_K
    assert gate_dynamic_k.forms_for("eagle_dynamic_k") == (STALE_K,) and gate_dynamic_k.forms_for("eagle") == ()
    assert STALE_CAPTURE != STALE_K


def test_a_dynamic_k_case_without_a_k_specialized_capture_cannot_vouch():
    """The probe counts FULL captures per K; a dynamic-K case whose build captured none (its backend cannot refresh
    draft metadata in place, so vLLM 0.34.0 does not specialize) tested nothing of the schedule."""
    from repro.vllm_integration.gate.case import GateCase
    from repro.vllm_integration.gate.coverage import unmet
    from repro.vllm_integration.gate.modes import GateMode
    from repro.vllm_integration.releases.builds import VllmBuild

    case = GateCase(VllmBuild(label="0.34.0", prefix=None), GateMode("plain"), method="eagle_dynamic_k")
    reason = "no FULL graph of a K-specialized descriptor was captured"
    assert any(reason in r for r in unmet(case, {"captures_by_k": {}}))
    assert not any(reason in r for r in unmet(case, {"captures_by_k": {"3": 3, "2": 3}}))
    plain = GateCase(VllmBuild(label="0.34.0", prefix=None), GateMode("plain"))
    assert not any(reason in r for r in unmet(plain, {"captures_by_k": {}}))


def test_the_probe_counts_each_k_specialized_full_capture(plugin_state):
    c, _ = audited()
    assert c["captures_by_k"] == {"3": 3, "2": 3}


class OneBuildPerShapeSpeculatorCudaGraphManager(sd.SpeculatorCudaGraphManager):
    """A release's bug of this class: each batch shape's metadata built once, in its first K's pass, and handed to
    every K's capture of that shape (the auditor before the K-keyed check passed it: nothing but K differs)."""

    def capture(self, forward_fn, builder, wrong=False, progress_bar_desc="x"):
        kept = {}

        def create_forward_fn(desc, warmup):
            key = (desc.num_tokens, warmup)
            if key not in kept:
                kept[key] = sd.prepare_inputs_to_capture(desc.num_reqs, desc.num_tokens, builder, 1)
            md = kept[key]
            return lambda cg_mode: forward_fn(md)

        sd.CudaGraphManager.capture(self, create_forward_fn, progress_bar_desc)


def test_a_capture_manager_that_builds_once_per_shape_across_ks_is_caught(plugin_state):
    mod = sd._backend()
    assert backend_hooks.install(mod, sd.CUDA)
    runner = sd.Runner(mod)
    spec = DynamicKSpeculator(runner)
    spec.decode_cudagraph_manager = OneBuildPerShapeSpeculatorCudaGraphManager(spec.decode_cudagraph_manager.descs)
    spec.decode_cudagraph_manager.capture(runner.forward, runner.builder)
    found = counters.AUDITOR.mismatches
    assert found and {(m.kind, m.buffer) for m in found} == {(STALE_DESCRIPTOR, "num_speculative_tokens")}


def test_the_dynamic_k_mutant_builds_once_per_shape_and_parses(tmp_path):
    """scripts/mutate_vllm.py's dynamic-k-one-build-per-shape: the AR capture's inputs prepared once per (mode,
    shape, pass) for K-specialized descriptors, what OneBuildPerShapeSpeculatorCudaGraphManager does above; the
    patched function is valid Python."""
    import ast
    import importlib.util
    import sys as _sys

    path = Path(__file__).resolve().parent.parent / "scripts" / "mutate_vllm.py"
    spec = importlib.util.spec_from_file_location("mutate_vllm", path)
    mv = _sys.modules.setdefault("mutate_vllm", importlib.util.module_from_spec(spec))
    spec.loader.exec_module(mv)
    mutant = mv.MUTANTS["dynamic-k-one-build-per-shape"]
    body = "def create_forward_fn(self, desc, warmup):\n    if True:\n" + mutant.replacement
    ast.parse(body)
    assert "isinstance(desc, SpeculatorBatchDescriptor)" in mutant.replacement
    assert "attn_metadata, slot_mappings = _kept[_shape]" in mutant.replacement
    assert set(mutant.methods) == {gate_dynamic_k.name_of(b) for b in gate_dynamic_k.BASES}
