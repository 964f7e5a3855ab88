"""The gate worker runs vLLM's model-class inspection in its own process (worker.inspect_in_process): vLLM's registry
starts a fresh interpreter per class on an empty cache (44 s of every cold case on the H200, results/h200-fast-cold)."""

import sys
import types

import pytest

from repro.vllm_integration.gate import worker


def _fake_registry(monkeypatch, **attrs) -> types.ModuleType:
    names = ("vllm", "vllm.model_executor", "vllm.model_executor.models", "vllm.model_executor.models.registry")
    mods = [types.ModuleType(n) for n in names]
    for parent, child in zip(mods, mods[1:]):
        setattr(parent, child.__name__.rsplit(".", 1)[1], child)
    for k, v in attrs.items():
        setattr(mods[-1], k, v)
    for m in mods:
        monkeypatch.setitem(sys.modules, m.__name__, m)
    return mods[-1]


def _never(fn):
    raise AssertionError("vLLM's subprocess ran")


def test_the_inspection_runs_in_the_case_process_with_the_same_result(monkeypatch):
    monkeypatch.delenv(worker.INSPECT_ENV, raising=False)
    registry = _fake_registry(monkeypatch, _run_in_subprocess=_never)
    assert worker.inspect_in_process() == "in-process"
    assert registry._run_in_subprocess(lambda: {"is_text_generation_model": True}) == {"is_text_generation_model": True}


def test_the_environment_leaves_vllms_own_process(monkeypatch):
    registry = _fake_registry(monkeypatch, _run_in_subprocess=_never)
    assert worker.inspect_in_process(vllm_inspects=True) == f"vLLM's own process ({worker.INSPECT_ENV}=vllm)"
    assert registry._run_in_subprocess is _never


@pytest.mark.parametrize("attrs", [{}, {"_run_in_subprocess": None}], ids=["absent", "not-callable"])
def test_a_registry_without_the_function_is_left_alone_and_said(monkeypatch, attrs):
    monkeypatch.delenv(worker.INSPECT_ENV, raising=False)
    _fake_registry(monkeypatch, **attrs)
    assert worker.inspect_in_process() == "vLLM's own process (its registry has no _run_in_subprocess)"
