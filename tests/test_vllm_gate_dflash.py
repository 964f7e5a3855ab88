"""The `dflash` method of the gate (repro.vllm_integration.gate.methods): applicable where the build's method table
resolves dflash to a speculator whose capture() records graphs, not applicable with the reason elsewhere; its pair
(the Llama target, a two-layer DFlash draft vLLM 0.34.0 accepts with dummy weights and no tokenizer) written by the
harness; readable case ids; the family members without an agreeing pair refused by name, pointing to dflash."""

from __future__ import annotations

import json

import pytest

from repro.vllm_integration.gate import methods
from repro.vllm_integration.gate.case import reference_for
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.run import plan
from repro.vllm_integration.gate.worker import llm_kwargs, write_models
from repro.vllm_integration.plugin import weights
from repro.vllm_integration.releases.builds import VllmBuild
from tests.test_vllm_gate_methods import SPEC, _tree, table_tree


def dflash_tree(root, capture_body: str):
    """table_tree plus 0.34.0's DFlash layout: the method table's dflash entry, its config, its speculator."""
    table_tree(root, "self.prefill_cudagraph_manager.capture(self._prefill)")
    table = root / SPEC / "speculator_config.py"
    table.write_text(
        table.read_text().replace(
            '"eagle3": _builtin(',
            '"dflash": _builtin("dflash.config", "DFlashSpeculatorConfig"),\n    "eagle3": _builtin(',
        )
    )
    return _tree(
        root,
        {
            f"{SPEC}/dflash/config.py": """
                from vllm.v1.worker.gpu.spec_decode.speculator_config import DraftModelSpeculatorConfig
                class DFlashSpeculatorConfig(DraftModelSpeculatorConfig):
                    base_method = "dflash"
                    speculator_class = (
                        "vllm.v1.worker.gpu.spec_decode.dflash.speculator.DFlashSpeculator"
                    )
                """,
            f"{SPEC}/dflash/speculator.py": f"""
                from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
                class DFlashSpeculator(BaseSpeculator):
                    def capture(self) -> None:
                        {capture_body}
                """,
        },
    )


def test_dflash_is_applicable_where_the_method_table_resolves_it_to_a_capturing_speculator(tmp_path):
    real = dflash_tree(tmp_path / "a", "self.query_cudagraph_manager.capture(self._generate_draft)")
    assert methods.not_applicable(real / "vllm", "dflash") is None
    noop = dflash_tree(tmp_path / "b", "pass")
    why = methods.not_applicable(noop / "vllm", "dflash")
    assert why and "DFlashSpeculator" in why and "records nothing" in why
    older = table_tree(tmp_path / "c", "pass")  # a method table without dflash
    why = methods.not_applicable(older / "vllm", "dflash")
    assert why and "not a speculative method of this build" in why


@pytest.mark.parametrize("member", ["dflash2", "lilicorr", "xpress", "dspark"])
def test_a_dflash_family_member_without_a_pair_is_refused_by_name_pointing_to_dflash(member):
    with pytest.raises(ValueError, match="no agreeing") as e:
        methods.parse_methods(f"eagle,{member}")
    assert "use dflash" in str(e.value) and "DFlashSpeculator.capture" in str(e.value)
    assert member not in methods.parse_methods("all")


def test_all_is_the_methods_measured_on_a_gpu_dflash_included():
    assert methods.parse_methods("all") == methods.ALL == ("eagle", "eagle3", "draft_model", "mtp", "dflash")
    assert methods.parse_methods("dflash") == ("dflash",)


def test_the_dflash_pair_is_the_llama_target_and_a_two_layer_dflash_draft_vllm_accepts(tmp_path):
    target, draft = write_models(tmp_path, "dflash")
    assert target == write_models(tmp_path, "eagle")[0]  # the methods share the Llama target's folder
    t, d = (json.loads((p / "config.json").read_text()) for p in (target, draft))
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    dc = d["dflash_config"]
    assert dc["causal"] is False and dc["mask_token_id"] < weights.SPECIAL  # a special id (pad): never decoded
    # the construction's room: two layers (the second reads what the first's lookup wrote), the lookup's units
    assert d["num_hidden_layers"] == 2 and d["intermediate_size"] >= t["vocab_size"] + weights.CODE_DIMS
    # DFlash's target_layer_ids are "after layer i": each must be one of the target's layers
    assert dc["target_layer_ids"] and all(0 <= i < t["num_hidden_layers"] for i in dc["target_layer_ids"])
    for k in ("hidden_size", "head_dim", "num_attention_heads", "num_key_value_heads", "vocab_size", "rope_theta"):
        assert d[k] == t[k], k  # the construction's geometry; the embedding and LM head are the target's (shared)
    spec = llm_kwargs(target, draft, False, 3, 0.1, "TRITON_ATTN", method="dflash")["speculative_config"]
    # the draft's backend is named: DFlash's loader would choose its own (FLASH_ATTN on Hopper) for a TRITON_ATTN case
    assert spec == {
        "method": "dflash",
        "num_speculative_tokens": 3,
        "model": str(draft),
        "attention_backend": "TRITON_ATTN",
    }
    eagle = llm_kwargs(target, draft, False, 3, 0.1, "TRITON_ATTN", method="eagle")["speculative_config"]
    assert "attention_backend" not in eagle  # EAGLE's draft inherits the target's, as every record ran it


def test_dflash_cases_carry_a_readable_method_id_and_their_own_reference():
    cases = plan([VllmBuild("0.34.0", None)], (GateMode.parse("audit"),), 1, 60.0, methods=("dflash",))
    ids = [c.case_id for c in cases]
    assert ids[0] == "stale_metadata-vllm-0.34.0-under-test-dflash-audit"
    assert all("-dflash-" in i for i in ids) and {c.method for c in cases} == {"dflash"}
    assert reference_for(cases[0]).case_id == "stale_metadata-vllm-0.34.0-under-test-dflash-reference-sm-all"


def _forms_run(verdicts: dict[tuple[str, str], str]):
    """A gate run of 0.34.0's dflash cases in audit and plain: the build clean, each self control form's verdict
    from `verdicts` ((mode, form) -> verdict), each result holding the expectation the gate fixes before it runs."""
    from repro.case.spec import CaseResult
    from repro.vllm_integration.gate.case import GateCase, expected
    from repro.vllm_integration.gate.outcome import GateRun
    from repro.vllm_integration.plugin.inject import INJECTIONS
    from repro.vllm_integration.releases.builds import UNDER_TEST

    build = VllmBuild("0.34.0", None, UNDER_TEST, "0.34.0")
    cases = []
    for mode in ("audit", "plain"):
        case = GateCase(build, GateMode.parse(mode), method="dflash", compile="none")
        cases.append((case, CaseResult(case.case_id, "clean", "", expected=expected(case))))
        for form in INJECTIONS:
            sc = GateCase(build, GateMode.parse(mode), method="dflash", compile="none", inject=form)
            cases.append((sc, CaseResult(sc.case_id, verdicts[mode, form], "", expected=expected(sc))))
    return GateRun(cases=cases)


CAUGHT = {
    ("audit", "stale-capture"): "stale-audit",
    ("audit", "stale-descriptor"): "stale-audit",
    ("plain", "stale-capture"): "clean",  # results/h200-dflash-0.34.0-2: the graph recomputes what this form wrote
    ("plain", "stale-descriptor"): "crash",
}


def test_a_self_control_form_silent_in_plain_beside_a_caught_form_passes_listed_as_a_miss():
    run = _forms_run(CAUGHT)
    assert run.outcome() == "PASS", run.decision().failures
    (miss,) = run.decision().form_misses
    assert "dflash-compile-none-plain: clean (caught by " in miss and "stale-descriptor" in miss.split("caught by")[1]


@pytest.mark.parametrize(
    "silent",
    [("plain", "stale-descriptor"), ("audit", "stale-capture"), ("audit", "stale-descriptor")],
    ids=lambda s: "-".join(s),
)
def test_a_self_control_is_harness_blind_when_no_form_of_a_mode_or_one_form_in_the_audit_is_caught(silent):
    """Plain: both forms silent; audit: every form must be caught by the auditor on its own (rule 1, not 6)."""
    run = _forms_run({**CAUGHT, silent: "clean"})
    assert run.outcome() == "HARNESS BLIND"
    assert any(silent[0] in f and "self-control" in f for f in run.blind())


def _tier_in_plain(monkeypatch, tmp_path, capture: str, descriptor: str) -> dict:
    """cases/test_vllm_gate.py's test for 0.34.0's dflash in plain, its run (the build clean, its self control's two
    forms with these verdicts) handed in as run_gate's answer: the properties it recorded."""
    import cases.test_vllm_gate as tier
    import repro.vllm_integration.gate.run as gate_run
    from repro.run.pytest_cases import RUN_ENV

    run = _forms_run({**CAUGHT, ("plain", "stale-capture"): capture, ("plain", "stale-descriptor"): descriptor})
    plain = GateMode.parse("plain")
    run.cases = [(c, r) for c, r in run.cases if c.mode == plain]
    monkeypatch.setattr(tier, "gpu_skip_reason", lambda: None)
    monkeypatch.setattr(gate_run, "run_gate", lambda *a, **k: run)  # the tier imports it when it runs
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(RUN_ENV, str(tmp_path / "logs"))
    build = run.cases[0][0].build
    props: dict = {}
    tier.test_stale_metadata_vllm_gate((build, plain, [build], "dflash"), props.__setitem__)
    return props


def test_the_pytest_tier_judges_a_self_controls_forms_together_as_the_gate_does(monkeypatch, tmp_path):
    """The pytest GPU tier: a silent form beside a caught one passes, listed; no form caught is HARNESS BLIND."""
    props = _tier_in_plain(monkeypatch, tmp_path, "clean", "crash")
    (miss,) = json.loads(props["self_control_form_misses"])
    assert "self-control-dflash-compile-none-plain: clean (caught by" in miss
    with pytest.raises(AssertionError, match="HARNESS BLIND: the self control of vLLM 0.34.0: .*no evidence in any"):
        _tier_in_plain(monkeypatch, tmp_path, "clean", "clean")


def test_the_report_marks_a_form_fail_only_where_the_run_failed_it():
    """verdicts.md's ok column reads the run's stored decision: a silent form beside a caught one is ok (listed), both
    forms silent are FAIL, whatever each form's own expectation allows."""
    from repro.vllm_integration.gate.report import build_summary, rows

    def oks(run):
        return {r["case"]: r["ok"] for r in rows(run) if "plain" in r["case"] and "self-control" in r["case"]}

    assert set(oks(_forms_run(CAUGHT)).values()) == {True}
    blind = _forms_run({**CAUGHT, ("plain", "stale-descriptor"): "clean"})
    assert set(oks(blind).values()) == {False}
    assert [b["ok"] for b in build_summary(blind) if b["role"] == "self-control"] == [False, False]
