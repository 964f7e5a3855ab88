"""What every attention-layer GPU case does: skip with the precise reason when the machine lacks something (or report
the configuration as not applicable on this runner), run the case in its own process on the fast path
(repro.run.pytest_cases), record its verdict, evidence and stored expectation as JUnit properties, and hold it to that
expectation (repro.judge.policy). Shared by the case modules; not a test file."""

from __future__ import annotations

import os
import shutil

import pytest

from cases.gpu_env import backend_skip_reason, gpu_skip_reason, sanitizer_skip_reason
from repro.case.spec import CaseSpec
from repro.contract.verdicts import SKIP
from repro.judge.expectations import expectation, gate_mode
from repro.judge.policy import EXPECT_CLEAN, problem
from repro.report.pytest_gate import not_applicable
from repro.run.pytest_cases import case_executor, log_dir
from repro.run.runner import run_case
from repro.run.smcontrol import maybe_mps


def applicability(spec: CaseSpec) -> tuple[str, str] | None:
    """(why this configuration cannot exist on this runner, the repro.judge.policy.REQUIREMENTS feature), or None."""
    if spec.sm.kind == "mig" and not os.environ.get("REPRO_PINNED_DEVICE", "").startswith("MIG-"):
        return "no MIG slice pinned to this worker (MIG is off, or run with -n <slices> on a MIG runner)", "mig"
    if spec.sm.kind == "mps" and not shutil.which("nvidia-cuda-mps-control"):
        return "nvidia-cuda-mps-control not found", "mps"
    if spec.sanitizer and (why := sanitizer_skip_reason()):
        return why, "sanitizer"
    return None


def run_control(spec: CaseSpec, record_property) -> None:
    for reason in (gpu_skip_reason(), backend_skip_reason(spec.backend)):
        if reason:
            pytest.skip(reason)
    exp = expectation(spec)  # fixed before the case runs
    record_property("expected", exp)
    record_property("gate_mode", gate_mode(spec).name)
    if na := applicability(spec):
        pytest.skip(not_applicable(*na, record_property))
    with maybe_mps(spec.sm.kind == "mps") as mps:
        res = run_case(spec, log_dir(), mps, case_executor())
    res.expected = exp
    for k, v in (
        ("case_id", res.case_id),
        ("xdist_worker", os.environ.get("PYTEST_XDIST_WORKER", "main")),
        ("pinned_device", os.environ.get("REPRO_PINNED_DEVICE")),
        ("gpu_uuid", res.gpu_uuid),
        ("wall_s", res.wall_s),
        ("verdict", res.verdict),
        ("evidence", res.evidence),
        ("kernel", res.kernel),
        ("descriptor", res.descriptor),
        ("reason", res.reason),
        ("stale_fields", res.stale_fields),
    ):
        record_property(k, v)
    if res.verdict == SKIP:
        pytest.skip(res.reason)
    why = problem(exp, res.verdict)
    if why and exp != EXPECT_CLEAN:
        pytest.fail(f"HARNESS BLIND in this environment: {why}: {res.reason}")
    assert why is None, f"{why} at {res.descriptor}: {res.reason}"
