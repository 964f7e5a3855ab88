"""Sleep and wake as a gate scenario (repro.vllm_integration.gate.sleep): every method again as <method>_sleep1 and
_sleep2, whose engine sleeps and wakes between its start (graphs captured) and its generate; the reference never
sleeps; level 2 keeps every parameter (the gate's constructed weights cannot be loaded again); a build without sleep
mode, or without the option level 2 needs, is not applicable with the reason; a case that never slept cannot vouch."""

from __future__ import annotations

from pathlib import Path

from repro.vllm_integration.gate import methods, sleep
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.coverage import unmet
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.worker import llm_kwargs
from repro.vllm_integration.releases.builds import VllmBuild

BUILD = VllmBuild(label="0.34.0", prefix=None)


def test_every_method_has_a_sleep_scenario_at_both_levels_with_its_own_pair():
    assert methods.parse_methods("sleep") == methods.SLEEP and len(methods.SLEEP) == 2 * len(methods.METHODS)
    for m in methods.METHODS:
        for level in sleep.LEVELS:
            spec = methods.TABLE[sleep.name_of(m, level)]
            assert spec.sleep_level == level and spec.base == m and spec.models() == methods.TABLE[m].models()
            assert spec.speculative_config(None, 3)["method"] == m


def test_the_engine_is_asked_for_sleep_mode_and_level_2_keeps_every_parameter(tmp_path):
    t, d = tmp_path / "t", tmp_path / "d"
    one = llm_kwargs(t, d, False, 3, 0.1, method="eagle3_sleep1")
    two = llm_kwargs(t, d, False, 3, 0.1, method="eagle3_sleep2")
    assert one["enable_sleep_mode"] is True and "sleep_preserve_parameter_names" not in one
    assert two["enable_sleep_mode"] is True and two["sleep_preserve_parameter_names"] == ["*", "draft.*"]
    assert "enable_sleep_mode" not in llm_kwargs(t, d, True, 3, 0.1, method="eagle3_sleep2")  # the reference
    assert "enable_sleep_mode" not in llm_kwargs(t, d, False, 3, 0.1, method="eagle3")


class FakeLLM:
    def __init__(self):
        self.calls = []

    def sleep(self, level=1):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True


def test_the_case_sleeps_then_wakes_before_it_generates_and_says_so():
    llm, counters = FakeLLM(), {"slept": None}
    sleep.sleep_and_wake(llm, 2, False, counters)
    assert llm.calls == [("sleep", 2), ("wake_up", None)] and counters["slept"] == 2
    ref, counters = FakeLLM(), {"slept": None}
    sleep.sleep_and_wake(ref, 2, True, counters)  # the reference never sleeps
    assert ref.calls == [] and counters["slept"] is None


def test_a_sleep_case_that_never_slept_cannot_vouch_and_its_id_says_the_level():
    case = GateCase(BUILD, GateMode("plain"), method="eagle3_sleep2")
    reason = "never reported that it slept and woke"
    assert any(reason in r for r in unmet(case, {"slept": None}))
    assert not any(reason in r for r in unmet(case, {"slept": 2}))
    assert not any(reason in r for r in unmet(GateCase(BUILD, GateMode("plain")), {"slept": None}))
    assert case.case_id == "stale_metadata-vllm-0.34.0-under-test-eagle3-sleep2-plain"


def _tree(root: Path, sleep_mode: bool = True, keep: bool = True) -> Path:
    spec = root / "v1" / "worker" / "gpu" / "spec_decode"
    spec.mkdir(parents=True)
    (root / "config").mkdir()
    (root / "entrypoints").mkdir()
    model = ("enable_sleep_mode: bool = False\n" if sleep_mode else "") + (
        "sleep_preserve_parameter_names: list = []\n" if keep else ""
    )
    (root / "config" / "model.py").write_text(model or "\n")
    (root / "entrypoints" / "llm.py").write_text("def sleep(self): ...\ndef wake_up(self): ...\n" if sleep_mode else "")
    return root


def test_a_build_without_sleep_mode_or_without_level_2s_option_is_not_applicable_with_the_reason(tmp_path):
    ok = _tree(tmp_path / "ok")
    assert methods.not_applicable(ok, "eagle_sleep1") is None and methods.not_applicable(ok, "eagle_sleep2") is None
    none = _tree(tmp_path / "none", sleep_mode=False)
    assert "no enable_sleep_mode" in methods.not_applicable(none, "eagle_sleep1")
    old = _tree(tmp_path / "old", keep=False)
    assert methods.not_applicable(old, "eagle_sleep1") is None
    assert "sleep_preserve_parameter_names" in methods.not_applicable(old, "eagle_sleep2")


def test_a_methods_name_gives_its_sleep_level():
    assert sleep.level_of("eagle_sleep2") == 2 and sleep.level_of("eagle") is None
    assert sleep.level_of("eagle_sleep3") is None and sleep.level_of("_sleep1") is None
