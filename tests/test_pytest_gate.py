"""The strict gate (--gate): on a machine without a GPU the GPU tier must fail, not pass; without --gate it skips.
A configuration this runner cannot have is not applicable (listed, not a failure) unless the run requires it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cases.gpu_env import gpu_skip_reason
from repro.judge.policy import parse_requirements
from repro.report import pytest_gate

ROOT = Path(__file__).resolve().parent.parent


def _pytest(*args):
    """A child pytest run of its own: not this run's xdist worker, log folder or GPU probe."""
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "REPRO_RUN_LOG", "REPRO_GPU_PROBE"))
    }
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-k", "stale_metadata and pair"]
    # the selected cases' folder only: collecting tests/ too imports every test module (3x the CPU time)
    return subprocess.run([*cmd, *args, "cases"], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)


@pytest.mark.skipif(gpu_skip_reason() is None, reason="a usable GPU is here: the GPU tier runs instead of skipping")
def test_gate_fails_where_the_gpu_tier_only_skips():
    plain = _pytest()
    assert plain.returncode == 0 and "skipped" in plain.stdout
    for extra in ((), ("-n", "2")):  # with xdist too: the controller stops before any worker starts
        gate = _pytest("--gate", *extra)
        out = (gate.stdout + gate.stderr).strip().splitlines()
        assert gate.returncode == 1
        assert len(out) <= 3 and "GATE FAILED: no GPU case can run here (no CUDA GPU" in out[-1]  # one clear line


def test_unknown_requirement_is_bad_input():
    r = _pytest("--gate", "--gate-require", "mig,bogus")  # the project's exit 2, not pytest's usage error (4)
    assert r.returncode == 2 and "unknown gate requirement" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _report(verdict, expected, mode="eager", when="call", na=None, needs=None, skipped=False):
    props = [("verdict", verdict), ("expected", expected), ("gate_mode", mode)]
    if na:
        props += [("not_applicable", na), ("needs", needs)]
    return types.SimpleNamespace(
        when=when,
        user_properties=props,
        nodeid=f"case-{verdict}-{mode}",
        skipped=skipped,
        passed=not skipped,
        failed=False,
        keywords={"gpu": 1, "stale_metadata": 1},
    )


def test_each_mode_needs_kernel_evidence_of_its_own():
    ev = pytest_gate.Evidence()
    for r in (_report("stale-audit", "audit"), _report("clean", "clean"), _report("crash", "fault", when="setup")):
        ev.add(r)
    assert len(ev.controls) == 2
    _, why = ev.summary()
    assert why and "mode eager" in why  # the attention-layer audit is bookkeeping, not a kernel's evidence
    ev.add(_report("wrong-output", "detected"))
    assert ev.summary()[1] is None
    ev.add(_report("stale-audit", "audit", mode="graph"))  # graph has controls, none with kernel evidence
    assert "mode graph" in ev.summary()[1]


def test_not_applicable_is_listed_unless_required():
    mig = _report("skip", "fault", na="no MIG slice pinned to this worker", needs="mig", skipped=True)
    ev = pytest_gate.Evidence()
    for r in (mig, _report("crash", "fault"), _report("clean", "clean")):
        ev.add(r)
    lines, why = ev.summary()
    assert why is None and any("not applicable (1): no MIG slice" in ln for ln in lines)
    strict = pytest_gate.Evidence(frozenset({"mig"}))
    for r in (mig, _report("crash", "fault"), _report("clean", "clean")):
        strict.add(r)
    assert "required (mig)" in strict.summary()[1]


def test_required_features_default_to_mig_on_a_mig_runner():
    from repro.errors import Unavailable
    from repro.run.smcontrol import GpuInfo, MigSlice

    def no_nvml():
        raise Unavailable("NVML unavailable")

    assert pytest_gate.required(None, {"REPRO_DEVICES": "MIG-a,MIG-b"}, no_nvml) == {"mig"}
    assert pytest_gate.required(None, {}, no_nvml) == frozenset()
    full = [GpuInfo(0, "NVIDIA H200", "GPU-1", 132, False)]
    sliced = [GpuInfo(0, "NVIDIA H200", "GPU-1", 132, True, (MigSlice(0, 0, "MIG-1", "1g.18gb", 16, 16384),))]
    assert pytest_gate.required(None, {}, lambda: full) == frozenset()
    assert pytest_gate.required(None, {}, lambda: sliced) == {"mig"}  # NVML finds slices: a MIG runner
    assert pytest_gate.required(None, {"REPRO_GATE_REQUIRE": "mps,vllm", "REPRO_DEVICES": "MIG-a"}) == {"mps", "vllm"}
    with pytest.raises(ValueError, match="unknown gate requirement"):
        parse_requirements("mig,gpus")


def test_skipped_case_fails_a_gate_unless_not_applicable():
    item = types.SimpleNamespace(get_closest_marker=lambda m: m == "gpu", nodeid="cases/x.py::t")

    def skipped(props):
        return types.SimpleNamespace(skipped=True, user_properties=props, longrepr=("f", 1, "Skipped: why"))

    r = skipped([])
    pytest_gate.skipped_to_failure(item, r, frozenset())
    assert r.outcome == "failed" and "could not run here" in r.longrepr
    na = [("not_applicable", "MIG off"), ("needs", "mig")]
    r = skipped(na)
    pytest_gate.skipped_to_failure(item, r, frozenset())
    assert not hasattr(r, "outcome")  # stays skipped
    r = skipped(na)
    pytest_gate.skipped_to_failure(item, r, frozenset({"mig"}))
    assert r.outcome == "failed" and "required by this run" in r.longrepr


def test_a_known_bad_build_silent_in_one_case_is_left_to_the_sessions_rule_5_not_failed_as_unrun():
    """cases/test_vllm_gate.py xfails a known-bad build's silent case (pytest reports it skipped, with wasxfail): it
    ran and recorded its verdict, so the session decides over its modes and methods (policy rule 5)."""
    item = types.SimpleNamespace(get_closest_marker=lambda m: m == "gpu", nodeid="cases/x.py::t")
    props = [("expected", "known-bad"), ("verdict", "clean")]
    r = types.SimpleNamespace(skipped=True, user_properties=props, longrepr=("f", 1, "silent"), wasxfail="silent")
    pytest_gate.skipped_to_failure(item, r, frozenset())
    assert not hasattr(r, "outcome")  # stays an xfail
    for other in ([("expected", "clean"), ("verdict", "clean")], [("expected", "known-bad")]):  # not such a case
        r = types.SimpleNamespace(skipped=True, user_properties=other, longrepr=("f", 1, "x"), wasxfail="x")
        pytest_gate.skipped_to_failure(item, r, frozenset())
        assert r.outcome == "failed"


def test_a_mode_with_only_negative_controls_fails_the_gate():
    """vLLM installed, no control named: the audit and plain cases are clean negatives only; the attention-layer
    controls must not stand in for them (repro gate says HARNESS BLIND there too)."""
    ev = pytest_gate.Evidence()
    for r in (_report("crash", "fault"), _report("clean", "clean"), _report("clean", "clean", mode="audit")):
        ev.add(r)
    _, why = ev.summary()
    assert why and "mode audit: no positive control ran" in why


def test_a_run_where_no_case_applies_fails_saying_it_checked_nothing_and_why():
    """repro gate answers CANNOT VOUCH for a build none of whose methods applies; the pytest tier fails the same way,
    naming the reasons, not as a blind harness."""
    ev = pytest_gate.Evidence()
    for mode in ("audit", "plain"):
        ev.add(_report("not-applicable", "clean", mode=mode, na="no specialize_spec_tokens in 0.33.0"))
    _, why = ev.summary()
    assert why == (
        "GATE FAILED: cannot vouch: no case applies here, so nothing was checked (no specialize_spec_tokens in 0.33.0)"
    )


def test_cpu_tests_and_crashed_workers_in_a_gate_run():
    ev = pytest_gate.Evidence()
    cpu = types.SimpleNamespace(**{**vars(_report("clean", "clean")), "keywords": {"test_redact": 1}})
    ev.add(cpu)
    assert ev.controls == [] and ev.unreported == []  # a CPU test is no control, and no missing one
    crashed = types.SimpleNamespace(**{**vars(_report("crash", "fault")), "when": "???", "failed": True})
    ev.add(crashed)
    assert ev.unreported == [crashed.nodeid]  # an xdist worker that died in a case: the gate has no verdict from it


def test_a_user_pinned_mig_slice_counts_as_pinned():
    from repro.run.pinning import PINNED_VAR, apply_pin, choose_pin

    env = {"CUDA_VISIBLE_DEVICES": "MIG-1234-abcd"}
    apply_pin(choose_pin("", env), env)
    assert env[PINNED_VAR] == "MIG-1234-abcd"
    assert pytest_gate.required(None, env, lambda: []) == {"mig"}
    full = {"REPRO_DEVICES": "GPU-1,GPU-2"}  # the run names full GPUs: MIG slices elsewhere on the host do not count
    assert pytest_gate.required(None, full, lambda: [object()]) == frozenset()


def test_the_gate_plugin_is_registered_only_for_a_gate_run(request):
    """This run's own config: no plugin object unless --gate (or REPRO_GATE=1) asked for one."""
    registered = request.config.pluginmanager.get_plugin(pytest_gate.PLUGIN_NAME)
    assert (registered is not None) == pytest_gate.enabled(request.config)


SESSION_CONFTEST = """
from repro.report import pytest_gate

pytest_plugins = ("repro.pytest_options",)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: a GPU case")
    if pytest_gate.enabled(config):  # as the checkout's conftest.py, with a GPU that is always there
        pytest_gate.GatePlugin.register(config, lambda: None)


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput"):
        print("gate plugin registered:", config.pluginmanager.get_plugin(pytest_gate.PLUGIN_NAME) is not None)
"""
SESSION_TESTS = """
import os

import pytest


def _control(record_property, verdict, expected):
    for k, v in (("verdict", verdict), ("expected", expected), ("gate_mode", "eager"), ("reason", "r")):
        record_property(k, v)


@pytest.mark.gpu
def test_positive(record_property):
    if os.environ.get("SKIP_POSITIVE"):
        pytest.skip("no FA3 build here")
    _control(record_property, os.environ.get("POSITIVE", "crash"), "detected")


@pytest.mark.gpu
def test_negative(record_property):
    _control(record_property, "clean", "clean")


def test_a_cpu_test():
    pass
"""


def _session(tmp_path, *args, **env):
    """A pytest session of its own in tmp_path: two GPU controls that record what they showed, one CPU test."""
    (tmp_path / "conftest.py").write_text(SESSION_CONFTEST)
    (tmp_path / "test_controls.py").write_text(SESSION_TESTS)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "REPRO_RUN_LOG", "REPRO_GATE"))}
    path = os.pathsep.join(filter(None, (str(ROOT), base.get("PYTHONPATH"))))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-s", *args]
    full = {**base, "PYTHONPATH": path, **env}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path, env=full)


def test_a_gate_session_decides_its_exit_status_and_writes_its_report(tmp_path):
    plain = _session(tmp_path, "-rN")
    assert plain.returncode == 0 and "gate plugin registered: False" in plain.stdout, plain.stdout[-2000:]
    assert "repro gate" not in plain.stdout
    passed = _session(tmp_path, "--gate", "--gate-report=out")
    assert passed.returncode == 0, passed.stdout[-2000:]
    assert "gate plugin registered: True" in passed.stdout and "repro gate" in passed.stdout
    assert "gate: 2 control(s) ran" in passed.stdout and "mode eager: 1 of 1 positive control(s)" in passed.stdout
    doc = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert doc["passed"] is True and doc["outcome"] == "GATE PASSED" and len(doc["controls"]) == 2
    assert "**GATE PASSED**" in (tmp_path / "out" / "gate.md").read_text()
    blind = _session(tmp_path, "--gate", POSITIVE="clean")  # every test passed; the gate did not
    assert blind.returncode == 1 and "3 passed" in blind.stdout and "GATE FAILED" in blind.stdout, blind.stdout[-2000:]


def test_in_a_gate_session_a_skipped_gpu_case_fails_in_the_worker_that_ran_it(tmp_path):
    pytest.importorskip("xdist")
    r = _session(tmp_path, "--gate", "-n", "2", SKIP_POSITIVE="1")
    assert r.returncode == 1, r.stdout[-2000:]
    assert "GATE: test_controls.py::test_positive could not run here" in r.stdout
    assert "GATE FAILED" in r.stdout and "gate plugin registered: True" in r.stdout
