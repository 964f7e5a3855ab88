"""The vLLM gate as pytest cases (markers gpu and vllm; ids contain stale_metadata): every vLLM build found (the
installed vllm, REPRO_VLLM=LABEL=PREFIX,..., REPRO_VLLM_CONTROL=LABEL=PREFIX,...) x detection mode (REPRO_GATE_MODES,
default audit,plain; see repro/vllm_integration/gate_case.py), each case in its own process under a timeout.

A build under test must come back clean and produce the greedy tokens of its own reference run (no speculative
decoding, no CUDA graphs, same SM configuration). A control (known bad) must be detected: a fault, a hang or wrong
tokens, or in the audit mode the auditor's stale views; a control that comes back clean FAILS as HARNESS BLIND. A case
whose checked feature did not fire (no FULL graphs, no speculative decoding, another backend, zero audit checks, ...)
is cannot-vouch and fails; the engine's configuration and the hooks' counters are recorded as properties.

    REPRO_VLLM_CONTROL=0.25.1=/opt/vllm-0.25.1 python -m pytest -m vllm cases/test_vllm_gate.py"""

from __future__ import annotations

import json
import os

import pytest

from cases.gpu_env import gpu_skip_reason
from repro.pytest_cases import log_dir
from repro.pytest_gate import not_applicable
from repro.smcontrol import maybe_mps
from repro.verdicts import SKIP
from repro.vllm_integration.builds import CONTROL, find_builds
from repro.vllm_integration.gate_case import DEFAULT_MODES, GateCase, expected, parse_modes, reference_for
from repro.vllm_integration.gate_judge import finish, meets
from repro.vllm_integration.gate_run import result_line, run_attributed, run_case

BUILDS = find_builds()
MODES = parse_modes(os.environ.get("REPRO_GATE_MODES", ",".join(DEFAULT_MODES)))
PARAMS = [pytest.param(b, m, id=f"{b.label}-{b.role}-{m.label}") for b in BUILDS for m in MODES] or [
    pytest.param(None, None, id="no-build")
]
_references: dict = {}  # (build, SM configuration) -> (reference result, its RESULT line)


@pytest.mark.gpu
@pytest.mark.vllm
@pytest.mark.parametrize("build,mode", PARAMS)
def test_stale_metadata_vllm_gate(build, mode, record_property):
    if build is None:
        why = "no vLLM build named or installed (pip install vllm, or REPRO_VLLM / REPRO_VLLM_CONTROL=LABEL=PREFIX)"
        pytest.skip(not_applicable(why, "vllm", record_property))
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    case = GateCase(build, mode)
    LOG_DIR = log_dir() / "vllm-gate"
    with maybe_mps(mode.sm.kind == "mps") as mps:
        ref_case = reference_for(case)
        key = (build, mode.sm)
        if key not in _references:
            ref = run_case(ref_case, BUILDS, LOG_DIR, mps)
            _references[key] = (ref, result_line(LOG_DIR, ref_case))
        res, _ = run_attributed(case, BUILDS, LOG_DIR, mps)
    ref, ref_out = _references[key]
    res = finish(case, res, result_line(LOG_DIR, case), ref, ref_out)  # the reference comparison, then what fired
    for k in ("verdict", "evidence", "kernel", "descriptor", "vllm_version", "wall_s"):
        record_property(k, getattr(res, k))
    record_property("role", build.role)
    record_property("expected", res.expected or expected(case))
    ident = res.backend_identity or {}
    record_property("engine", json.dumps(ident.get("engine"), default=str))
    record_property("counters", json.dumps(ident.get("counters"), default=str))
    record_property("acceptance", json.dumps(ident.get("acceptance"), default=str))
    record_property("gate_mode", mode.name)
    record_property("reason", res.reason)
    if res.verdict == SKIP:
        pytest.skip(res.reason)
    if build.role == CONTROL:
        assert meets(case, res), f"HARNESS BLIND: control vLLM {build.label} came back {res.verdict}: {res.reason}"
    else:
        assert meets(case, res), f"vLLM {build.label} ({mode.name}): {res.verdict}: {res.reason}"
