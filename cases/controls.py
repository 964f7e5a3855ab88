"""What every attention-layer GPU case does: skip with the precise reason when the machine lacks something, run the
case in its own process, record its verdict and evidence as JUnit properties, and hold it to its control's
expectation (repro.matrix.expectation, repro.verdicts.satisfies). Shared by the case modules; not a test file."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from cases.gpu_env import backend_skip_reason, gpu_skip_reason, sanitizer_skip_reason
from repro.case import CaseSpec
from repro.matrix import expectation
from repro.runner import run_case
from repro.smcontrol import maybe_mps
from repro.verdicts import MEMORY_FAULTS, SKIP, satisfies

LOG_DIR = os.environ.get("REPRO_LOG_DIR") or os.path.join(tempfile.gettempdir(), "repro-pytest-logs")


def run_control(spec: CaseSpec, record_property) -> None:
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
        ("evidence", res.evidence),
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
    if not ok and exp != "clean":
        pytest.fail(
            f"HARNESS BLIND in this environment: positive control expected "
            f"{'a memory fault' if exp == 'fault' else 'detection'}, got {res.verdict}: {res.reason}"
        )
    assert ok, f"negative control not clean: {res.verdict} at {res.descriptor}: {res.reason}"
    if exp == "fault":
        assert res.verdict in MEMORY_FAULTS
