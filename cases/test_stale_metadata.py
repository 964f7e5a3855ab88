"""GPU cases: FA3 x scenario x strategy x SM restriction x mode, each in its own process under a timeout.

Positive controls (stale) must be detected, negative controls (fresh) must be clean. A positive control that
comes back clean FAILS with "harness blind": this environment cannot see the bug, and passing would lie."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from cases.gpu_env import backend_skip_reason, gpu_skip_reason, sanitizer_skip_reason
from repro import pytest_gate
from repro.case import CaseSpec, SmConfig
from repro.descriptors import AttnConfig
from repro.matrix import expectation
from repro.runner import run_case
from repro.smcontrol import maybe_mps
from repro.verdicts import MEMORY_FAULTS, SKIP, satisfies

LOG_DIR = os.environ.get("REPRO_LOG_DIR") or os.path.join(tempfile.gettempdir(), "repro-pytest-logs")
BACKENDS = [pytest.param(b, id=b) for b in ("vllm", "upstream")]
STRATEGIES = [pytest.param("stale", id="stale"), pytest.param("fresh", id="fresh")]
SMS = [
    pytest.param("sm_margin:16", id="smmargin16"),
    pytest.param("full", id="sm-all"),
    pytest.param("mps:16", id="mps16", marks=pytest.mark.mps),
    pytest.param("mig", id="mig", marks=pytest.mark.mig),
]
MODES = [pytest.param("eager", id="eager"), pytest.param("graph", id="graph")]
SPLITS = [pytest.param(32, id="splits32"), pytest.param(0, id="splits0")]


def _run(spec: CaseSpec, record_property) -> None:
    for reason in (
        gpu_skip_reason(),
        backend_skip_reason(spec.backend),
        sanitizer_skip_reason() if spec.sanitizer else None,
    ):
        if reason:
            pytest.skip(reason)
    if spec.sm.kind == "mps" and not shutil.which("nvidia-cuda-mps-control"):
        pytest.skip("nvidia-cuda-mps-control not found")
    if spec.sm.kind == "mig" and not os.environ.get("REPRO_PINNED_DEVICE", "").startswith("MIG-"):
        pytest.skip("no MIG slice pinned to this worker (run with -n <slices> on a MIG runner)")
    with maybe_mps(spec.sm.kind == "mps") as mps:
        res = run_case(spec, LOG_DIR, mps)
    exp = expectation(spec)
    for k, v in (
        ("xdist_worker", os.environ.get("PYTEST_XDIST_WORKER", "main")),
        ("pinned_device", os.environ.get("REPRO_PINNED_DEVICE")),
        ("gpu_uuid", res.gpu_uuid),
        ("wall_s", res.wall_s),
        ("verdict", res.verdict),
        ("kernel", res.kernel),
        ("descriptor", res.descriptor),
        ("expected", exp),
        ("reason", res.reason),
        ("stale_fields", res.stale_fields),
    ):
        record_property(k, v)
    if res.verdict == SKIP:
        pytest.skip(res.reason)
    ok = satisfies(exp, res.verdict)
    if ok and exp != "clean" and pytest_gate.enabled() and res.verdict not in pytest_gate.KERNEL_EVIDENCE:
        pytest.fail(f"GATE: positive control detected only by the harness's audit ({res.verdict}), no kernel evidence")
    if not ok and exp != "clean":
        pytest.fail(
            f"HARNESS BLIND in this environment: positive control expected "
            f"{'a memory fault' if exp == 'fault' else 'detection'}, got {res.verdict}: {res.reason}"
        )
    assert ok, f"negative control not clean: {res.verdict} at {res.descriptor}: {res.reason}"
    if exp == "fault":
        assert res.verdict in MEMORY_FAULTS


@pytest.mark.gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sm", SMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_metadata_v2_capture(backend, strategy, sm, mode, splits, record_property):
    """vLLM V2 capture order; poisoned padding (int-max) makes stale outcomes repeatable."""
    spec = CaseSpec(
        backend,
        strategy,
        mode,
        sm=SmConfig.parse(sm),
        cfg=AttnConfig(num_splits=splits),
        poison="int-max",
        timeout_s=120,
    )
    _run(spec, record_property)


@pytest.mark.gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_metadata_memcheck_16sm(backend, strategy, record_property):
    """Unpoisoned, FA3's split heuristic at 16 SMs: memcheck names the faulting kernel (combine for upstream)."""
    spec = CaseSpec(
        backend,
        strategy,
        "eager",
        sm=SmConfig.parse("sm_margin:16"),
        cfg=AttnConfig(num_splits=0),
        sanitizer=True,
        timeout_s=180,
    )
    _run(spec, record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stale_metadata_pair(strategy, record_property):
    """Metadata built for one request, launched for eight."""
    spec = CaseSpec(
        "vllm",
        strategy,
        "eager",
        scenario="pair",
        pair=("t4r1", "t32r8"),
        poison="int-max",
        sm=SmConfig.parse("sm_margin:16"),
        timeout_s=120,
    )
    _run(spec, record_property)
