"""The speculative method vLLM ran against the one asked for (gate.coverage.method_problems): the gate's coverage
step compares a case's method with its process's request, vLLM's resolved speculative config and the method the
plugin saw the capturing runner configured with, and the speculator class the plugin recorded with the class the
build's own files resolve the method to; a mismatch cannot vouch, both named. `repro audit --expect-method` and
`pytest --repro-audit` use the same rule (tests/test_repro_audit.py, tests/test_pytest_audit.py). On the old code
the engine's `method` was recorded and never read: a build that resolved eagle to draft_model vouched as eagle."""

from __future__ import annotations

import copy

from repro.vllm_integration.gate import coverage
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild
from tests.test_vouch_rules import FIRED

BUILD = VllmBuild("x", "/nonexistent-prefix", UNDER_TEST, "0.34.0")


def _case(method: str = "eagle") -> GateCase:
    return GateCase(BUILD, GateMode.parse("audit"), method=method)


def _identity(engine: dict | None = None, counters: dict | None = None) -> dict:
    d = copy.deepcopy(FIRED)
    d["engine"].update({"method": "eagle", **(engine or {})})
    d["counters"].update(counters or {})
    return d


def test_the_method_vllm_resolved_to_another_one_cannot_vouch_with_both_named():
    why = coverage.not_fired(_case(), _identity(engine={"speculative_method": "draft_model"}))
    assert why == ["speculative method asked for: eagle; vLLM's speculative config ran: draft_model"]


def test_the_method_the_capturing_runner_ran_is_compared_too_each_engine_of_the_process():
    why = coverage.not_fired(_case(), _identity(counters={"speculative_methods": {"eagle": 4, "mtp": 2}}))
    assert why == ["speculative method asked for: eagle; the model runner the plugin saw capturing ran: mtp"]


def test_the_same_method_everywhere_vouches():
    assert coverage.not_fired(_case(), _identity(counters={"speculative_methods": {"eagle": 6}})) == []


def test_the_speculator_class_is_compared_with_the_build_s_files_where_both_say(tmp_path, monkeypatch):
    monkeypatch.setattr(coverage, "speculator_class", lambda package_dir, method: "StandaloneARSpeculator")
    why = coverage.not_fired(_case("draft_model"), _identity(engine={"method": "draft_model",
                             "speculative_method": "draft_model"}, counters={"speculator": "EagleSpeculator"}))  # fmt: skip
    assert why == ["speculator class expected: StandaloneARSpeculator; vLLM ran: EagleSpeculator"]
    monkeypatch.setattr(coverage, "speculator_class", lambda package_dir, method: None)  # files that do not say
    assert coverage.not_fired(_case(), _identity(counters={"speculator": "EagleSpeculator"})) == []


def test_method_problems_names_an_expected_capture_manager_missing_from_the_full_captures():
    counters = {"full_captures_by_manager": {"CudaGraphManager.cudagraph_manager of GPUModelRunner": 2}}
    why = coverage.method_problems(None, {}, counters, manager="SpeculatorCudaGraphManager")
    assert why == [
        "capture manager expected: SpeculatorCudaGraphManager; vLLM's FULL captures were by: "
        "CudaGraphManager.cudagraph_manager of GPUModelRunner"
    ]
    assert coverage.method_problems(None, {}, counters, manager="CudaGraphManager") == []


def _method_reasons(case: GateCase, identity: dict) -> list[str]:
    return [w for w in coverage.not_fired(case, identity) if w.startswith("speculative method")]


def test_a_scenario_method_vouches_where_vllm_ran_its_base_method():
    """A dynamic-K or sleep-and-wake case asks vLLM for its base method: the H100 record h100-dynamic-sleep-0.34.0
    (eagle_dynamic_k run as eagle, dflash_sleep1 as dflash) was a false CANNOT VOUCH on the old code."""
    for method, base in (
        ("eagle_dynamic_k", "eagle"),
        ("draft_model_dynamic_k", "draft_model"),
        ("dflash_sleep1", "dflash"),
    ):
        ident = _identity(
            engine={"method": method, "speculative_method": base}, counters={"speculative_methods": {base: 3}}
        )
        assert _method_reasons(_case(method), ident) == []


def test_a_scenario_method_run_as_another_base_cannot_vouch_with_both_named():
    ident = _identity(
        engine={"method": "eagle_dynamic_k", "speculative_method": "eagle3"},
        counters={"speculative_methods": {"eagle": 3}},
    )
    assert _method_reasons(_case("eagle_dynamic_k"), ident) == [
        "speculative method asked for: eagle_dynamic_k (vLLM's method eagle); vLLM's speculative config ran: eagle3"
    ]


def test_a_scenario_case_whose_process_requested_another_method_cannot_vouch():
    ident = _identity(
        engine={"method": "eagle", "speculative_method": "eagle"}, counters={"speculative_methods": {"eagle": 3}}
    )
    assert _method_reasons(_case("eagle_sleep2"), ident) == [
        "speculative method asked for: eagle_sleep2; the case process's request ran: eagle"
    ]
