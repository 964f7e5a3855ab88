"""The speculative method as a gate case parameter (repro.vllm_integration.gate.methods): readable case ids, a method
a build lacks (or captures no FULL draft graph for) not applicable with its reason and never clean, read from the
build's files; every method's pair written by the harness; a build prefix's .pth files in the case process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from repro.contract.verdicts import SKIP
from repro.judge import policy
from repro.judge.decision import GateOutcome
from repro.vllm_integration.gate import methods
from repro.vllm_integration.gate.case import GateCase, reference_for
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.outcome import GateRun, control_of
from repro.vllm_integration.gate.process import set_apart_not_applicable
from repro.vllm_integration.gate.run import plan
from repro.vllm_integration.gate.worker import llm_kwargs, write_models
from repro.vllm_integration.releases.builds import SITE_DIRS_ENV, VllmBuild

SPEC = "vllm/v1/worker/gpu/spec_decode"


def _tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(textwrap.dedent(text))
    return root


BASE = {
    f"{SPEC}/speculator.py": """
        class BaseSpeculator:
            def capture(self) -> None:
                pass
        """,
    f"{SPEC}/autoregressive/speculator.py": """
        from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
        class AutoRegressiveSpeculator(BaseSpeculator):
            def capture(self) -> None:
                self.prefill_cudagraph_manager.capture(self._prefill)
        """,
    f"{SPEC}/eagle/speculator.py": """
        from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import AutoRegressiveSpeculator
        class EagleSpeculator(AutoRegressiveSpeculator):
            pass
        """,
}


def table_tree(root: Path, draft_capture: str) -> Path:
    """A 0.27+ layout: speculator_config's method table; draft_model's speculator capture() as given."""
    return _tree(
        root,
        {
            **BASE,
            f"{SPEC}/speculator_config.py": """
                def _builtin(module, name):
                    return f"vllm.v1.worker.gpu.spec_decode.{module}.{name}"
                class SpeculatorConfig:
                    speculator_class = None
                class DraftModelSpeculatorConfig(SpeculatorConfig):
                    pass
                _CONFIG_BY_METHOD = {
                    "draft_model": _builtin("standalone_ar.config", "StandaloneARSpeculatorConfig"),
                    "eagle": _builtin("eagle.config", "EagleSpeculatorConfig"),
                    "eagle3": _builtin("eagle.config", "Eagle3SpeculatorConfig"),
                }
                """,
            f"{SPEC}/eagle/config.py": """
                from vllm.v1.worker.gpu.spec_decode.speculator_config import DraftModelSpeculatorConfig
                class EagleSpeculatorConfig(DraftModelSpeculatorConfig):
                    speculator_class = "vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator"
                class Eagle3SpeculatorConfig(EagleSpeculatorConfig):
                    base_method = "eagle3"
                """,
            f"{SPEC}/standalone_ar/config.py": """
                from vllm.v1.worker.gpu.spec_decode.speculator_config import DraftModelSpeculatorConfig
                class StandaloneARSpeculatorConfig(DraftModelSpeculatorConfig):
                    speculator_class = (
                        "vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator.StandaloneARSpeculator"
                    )
                """,
            f"{SPEC}/standalone_ar/speculator.py": f"""
                from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
                class StandaloneARSpeculator(BaseSpeculator):
                    def capture(self) -> None:
                        {draft_capture}
                """,
        },
    )


def test_a_method_the_build_captures_no_full_graph_for_is_not_applicable_with_its_reason(tmp_path):
    noop = table_tree(tmp_path / "a", '"""No graphs yet."""')
    why = methods.not_applicable(noop / "vllm", "draft_model")
    assert why and "capture() records nothing" in why and "StandaloneARSpeculator" in why
    real = table_tree(tmp_path / "b", "self.prefill_cudagraph_manager.capture(self._prefill)")
    assert methods.not_applicable(real / "vllm", "draft_model") is None
    # eagle3 inherits its speculator class from EagleSpeculatorConfig, its capture() from AutoRegressiveSpeculator
    assert methods.not_applicable(real / "vllm", "eagle3") is None
    why = methods.not_applicable(real / "vllm", "mtp")
    assert why and "not a speculative method of this build" in why and "draft_model, eagle, eagle3" in why


def test_init_speculator_branches_say_which_methods_an_older_build_has(tmp_path):
    root = _tree(
        tmp_path,
        {
            **BASE,
            f"{SPEC}/__init__.py": """
                def init_speculator(vllm_config, device):
                    speculative_config = vllm_config.speculative_config
                    if speculative_config.method == "mtp":
                        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
                        return EagleSpeculator(vllm_config, device)
                    elif speculative_config.use_eagle():
                        from vllm.v1.worker.gpu.spec_decode.eagle.speculator import EagleSpeculator
                        return EagleSpeculator(vllm_config, device)
                    raise NotImplementedError
                """,
        },
    )
    for m in ("eagle", "eagle3", "mtp"):
        assert methods.not_applicable(root / "vllm", m) is None, m
    assert "no branch for method 'draft_model'" in methods.not_applicable(root / "vllm", "draft_model")
    # 0.33.0's shape: a predicate branch (uses_draft_model()) to a speculator whose capture() is `pass`
    init = (
        (root / SPEC / "__init__.py")
        .read_text()
        .replace(
            "    raise NotImplementedError",
            "    elif speculative_config.uses_draft_model():\n"
            "        from vllm.v1.worker.gpu.spec_decode.standalone_ar.speculator import StandaloneARSpeculator\n"
            "        return StandaloneARSpeculator(vllm_config, device)\n"
            "    raise NotImplementedError",
        )
    )
    (root / SPEC / "__init__.py").write_text(init)
    _tree(root, {f"{SPEC}/standalone_ar/speculator.py": """
        from vllm.v1.worker.gpu.spec_decode.speculator import BaseSpeculator
        class StandaloneARSpeculator(BaseSpeculator):
            def capture(self) -> None:
                pass  # CUDA graph not yet supported for standalone AR speculator.
        """})  # fmt: skip
    assert "capture() records nothing" in methods.not_applicable(root / "vllm", "draft_model")


def test_a_build_without_method_dispatch_runs_eagle_only(tmp_path):
    root = _tree(tmp_path, BASE)
    assert methods.not_applicable(root / "vllm", "eagle") is None
    assert "EAGLE only" in methods.not_applicable(root / "vllm", "mtp")


def test_methods_parse_with_all_and_refuse_unknown_twice_and_a_dflash_member_without_a_pair():
    assert methods.parse_methods("all") == methods.ALL == methods.METHODS
    assert methods.parse_methods(" MTP , eagle ") == ("mtp", "eagle")
    for bad, words in (("medusa", "use eagle"), ("eagle,eagle", "twice"), ("dflash2", "no agreeing DFlash2 draft")):
        with pytest.raises(ValueError, match=words):
            methods.parse_methods(bad)


def test_each_method_is_a_case_parameter_with_a_readable_id_and_its_own_reference():
    b = VllmBuild("0.34.0", None)
    cases = plan([b], (GateMode.parse("audit"),), 1, 60.0, methods=("eagle", "draft_model"))
    ids = [c.case_id for c in cases]
    assert ids == [
        "stale_metadata-vllm-0.34.0-under-test-audit",  # eagle: the id as recorded
        "stale_metadata-vllm-0.34.0-self-control-audit",
        "stale_metadata-vllm-0.34.0-self-control-stale-descriptor-audit",  # the second form of the injection
        "stale_metadata-vllm-0.34.0-under-test-draft-model-audit",
        "stale_metadata-vllm-0.34.0-self-control-draft-model-audit",
        "stale_metadata-vllm-0.34.0-self-control-stale-descriptor-draft-model-audit",
    ]
    refs = {reference_for(c).case_id for c in cases}
    assert refs == {
        "stale_metadata-vllm-0.34.0-under-test-reference-sm-all",
        "stale_metadata-vllm-0.34.0-under-test-draft-model-reference-sm-all",
    }
    round_trip = GateCase.from_dict(json.loads(cases[3].to_json()))
    assert round_trip == cases[3] and round_trip.method == "draft_model"


def test_a_not_applicable_method_runs_nothing_and_is_listed_never_clean(tmp_path):
    prefix = _tree(tmp_path, BASE)  # no dispatch: eagle only
    b = VllmBuild("old", str(prefix))
    cases = plan([b], (GateMode.parse("plain"),), 1, 60.0, methods=("eagle", "mtp"))
    run_cases, na = set_apart_not_applicable(cases)
    # each method: the build, its self control in both injection forms
    assert [c.method for c in run_cases] == ["eagle"] * 3 and [c.method for c, _ in na] == ["mtp"] * 3
    for c, r in na:
        assert r.verdict == SKIP and "EAGLE only" in r.not_applicable and r.reason.startswith("not applicable")
        assert control_of(c, r).not_applicable == r.not_applicable
    run = GateRun(cases=na)
    assert run.affected() == []  # not a build under test that errored or skipped: it lacks the method
    d = policy.decide(run.controls())
    assert [c for c, _ in d.not_applicable] == [c.case_id for c, _ in na] and d.ran == 0


@pytest.mark.parametrize("method", methods.METHODS)
def test_every_method_gets_its_pair_and_speculative_config(tmp_path, method):
    target, draft = write_models(tmp_path, method)
    kw = llm_kwargs(target, draft, False, 3, 0.1, method=method)
    spec = kw["speculative_config"]
    assert spec["method"] == method and spec["num_speculative_tokens"] == 3
    tcfg = json.loads((target / "config.json").read_text())
    if method == "mtp":
        assert draft is None and "model" not in spec and tcfg["num_nextn_predict_layers"] == 1
        assert tcfg["hidden_size"] // tcfg["num_attention_heads"] == 128
    else:
        dcfg = json.loads((draft / "config.json").read_text())
        assert spec["model"] == str(draft) and dcfg["vocab_size"] == tcfg["vocab_size"]
    if method == "eagle3":
        assert len(set(dcfg["eagle_aux_hidden_state_layer_ids"])) == 3
        assert max(dcfg["eagle_aux_hidden_state_layer_ids"]) <= tcfg["num_hidden_layers"]


def test_a_build_prefix_pth_file_takes_effect_in_the_case_process(tmp_path):
    prefix, extra = tmp_path / "site-packages", tmp_path / "elsewhere"
    extra.mkdir()
    (extra / "standin_cutlass.py").write_text("WHERE = 'through the .pth'\n")
    prefix.mkdir()
    (prefix / "standin.pth").write_text(str(extra) + "\n")
    code = (
        "from repro.vllm_integration.releases.builds import add_site_dirs; print(add_site_dirs()); "
        "import standin_cutlass; print(standin_cutlass.WHERE)"
    )
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(prefix), root])}
    plain = subprocess.run([sys.executable, "-c", code.split("; ", 2)[2]], env=env, capture_output=True, text=True)
    assert plain.returncode != 0 and "standin_cutlass" in plain.stderr  # PYTHONPATH alone: no .pth processed
    env[SITE_DIRS_ENV] = str(prefix)
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str([str(prefix)]), "through the .pth"]


def test_the_report_has_a_row_per_method_and_a_lacking_method_reads_not_applicable(tmp_path):
    from repro.case.spec import CaseResult
    from repro.contract.verdicts import CLEAN
    from repro.vllm_integration.gate import report

    prefix = _tree(tmp_path, BASE)  # EAGLE only
    b = VllmBuild("0.2x", str(prefix), version="0.2x")
    cases = plan([b], (GateMode.parse("plain"),), 1, 60.0, self_control="none", methods=("eagle", "mtp"))
    ran, na = set_apart_not_applicable(cases)
    run = GateRun(cases=[(ran[0], CaseResult(ran[0].case_id, CLEAN, "tokens match", expected="clean")), *na])
    rows = {s["build"]: s for s in report.build_summary(run)}
    assert set(rows) == {"0.2x", "0.2x mtp"} and rows["0.2x"]["method"] == "eagle"
    assert "EAGLE only" in rows["0.2x mtp"]["not_applicable"] and rows["0.2x mtp"]["ok"]
    md = report.markdown(run)
    assert "| 0.2x mtp | under-test | 0.2x | **not applicable** |" in md
    assert "| 0.2x | under-test | 0.2x | **no** |" in md
    assert [s["build"] for s in report.releases_only(report.build_summary(run))] == ["0.2x"]
    assert run.outcome() != GateOutcome.CANNOT_VOUCH  # a lacking method is no unanswered case
    assert {r["method"] for r in report.rows(run)} == {"eagle", "mtp"}


def test_each_capture_is_counted_under_its_capture_manager_and_dflash_query_is_a_draft_kind():
    import sys as _sys

    from repro.vllm_integration.plugin import capture

    def make(manager_name: str, owner_name: str, attr: str):
        seen = {}
        mgr_cls = type(manager_name, (), {"capture": lambda self: seen.update(
            manager=capture.manager_of(_sys._getframe()), kind=capture.graph_kind(_sys._getframe()))})  # fmt: skip

        def run(self):
            getattr(self, attr).capture()

        owner = type(owner_name, (), {"run": run})()
        setattr(owner, attr, mgr_cls())
        owner.run()
        return seen

    got = make("SpeculatorCudaGraphManager", "StandaloneARSpeculator", "prefill_cudagraph_manager")
    assert got == {
        "manager": "SpeculatorCudaGraphManager.prefill_cudagraph_manager of StandaloneARSpeculator",
        "kind": "draft prefill",
    }
    got = make("DFlashCudaGraphManager", "DFlashSpeculator", "query_cudagraph_manager")
    assert got["kind"] == "draft query" and got["manager"].endswith("query_cudagraph_manager of DFlashSpeculator")
    assert capture.manager_of(_sys._getframe()) == capture.UNKNOWN_KIND  # no manager on this stack


def test_the_bare_gate_runs_every_method_the_harness_covers():
    """`python -m repro gate` with no --methods vouches for every capture path (EAGLE/EAGLE3/MTP's manager, the
    draft-model speculator's, the DFlash family's): a mutant of one manager is caught by its own method alone."""
    from repro.cli import build_parser
    from repro.vllm_integration.gate.methods import ALL, DFLASH, DRAFT_MODEL

    got = build_parser().parse_args(["gate"]).methods
    assert got == ALL and DRAFT_MODEL in got and DFLASH in got
    assert build_parser().parse_args(["gate", "--methods", "eagle"]).methods == ("eagle",)
