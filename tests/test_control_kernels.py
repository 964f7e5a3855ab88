"""A self control's plain crash is its mode's evidence whichever kernel faulted: by default the gate starts no
CUDA_LAUNCH_BLOCKING=1 rerun beside it (GateCase.name_kernel), which bound a third of a warm default run's
process-seconds; `gate --name-control-kernels` asks for it. A known-bad build's and a build's own crash keep theirs.
Stand-in case processes: the fake vLLM (tests/fake_vllm.py) through the real launcher."""

from __future__ import annotations

import pytest

from repro.contract.verdicts import CRASH
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.releases.builds import CONTROL, UNDER_TEST, parse_builds
from tests.fake_vllm import write_fake_vllm


@pytest.mark.parametrize("control_kernels", [False, True], ids=["default", "name-control-kernels"])
def test_a_self_controls_crash_is_rerun_to_name_its_kernel_only_when_asked(tmp_path, control_kernels):
    good = parse_builds(f"good={write_fake_vllm(tmp_path / 'good', '0.26.0', 'good')}", UNDER_TEST, "x")
    bad = parse_builds(f"bad={write_fake_vllm(tmp_path / 'bad', '0.25.1', 'stale-crash')}", CONTROL, "x")
    kw = dict(jobs=4, timeout_s=120, launcher="fork", control_kernels=control_kernels)
    run = run_gate(good + bad, parse_modes("plain"), tmp_path / "logs", **kw)
    assert run.outcome() == "PASS"
    controls = {c.case_id: r for c, r in run.cases if c.inject is not None}
    assert len(controls) == 2 and {r.verdict for r in controls.values()} == {CRASH}  # both forms crashed
    reruns = {c.case_id.removesuffix("-launch-blocking") for c, _ in run.attributions}
    known_bad = next(c.case_id for c, _ in run.cases if c.build.label == "bad")
    assert known_bad in reruns  # a known-bad build's crash is always attributed
    assert (set(controls) <= reruns) is control_kernels and (set(controls) & reruns == set()) is not control_kernels
    for r in controls.values():  # named only by its rerun: the crash alone says no kernel
        assert bool(r.kernel) is control_kernels
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert any("self-control-plain-launch-blocking" in n for n in logs) is control_kernels  # no process started
