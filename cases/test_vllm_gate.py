"""The vLLM gate as pytest cases (markers gpu and vllm; ids contain stale_metadata): every vLLM build found (the
installed vllm, REPRO_VLLM=LABEL=PREFIX,..., REPRO_VLLM_CONTROL=LABEL=PREFIX,...) x speculative method (REPRO_GATE_METHODS, default all; or eagle, eagle3, draft_model,
mtp, dflash: repro/vllm_integration/gate/methods.py) x detection mode (REPRO_GATE_MODES, default audit,plain; see
repro/vllm_integration/gate/case.py). A method the build lacks is a skip that says why (not applicable).

Each test is one build in one mode, run by the gate's own orchestrator (repro.vllm_integration.gate.run.run_gate,
`only` that build): the same case processes, timeouts, MPS daemon handling, reference cache (REPRO_CACHE_DIR, shared
by every test and every xdist worker) and judging as `python -m repro gate`, with the build's self control beside it
(REPRO_SELF_CONTROL, default under-test). A build under test must come back clean against its own validated
reference; a control (known bad) must be detected, a self control in at least one of its forms per mode (policy rule
6); a case whose checked feature did not fire is
cannot-vouch and fails. The engine's configuration and the hooks' counters are recorded as properties.

    REPRO_VLLM_CONTROL=0.25.1=/opt/vllm-0.25.1 python -m pytest -m vllm cases/test_vllm_gate.py"""

from __future__ import annotations

import json

import pytest

from cases.gpu_env import gpu_skip_reason
from repro.contract.verdicts import SKIP
from repro.judge import policy
from repro.judge.decision import CONTROL_FAILED
from repro.report.pytest_gate import NOT_APPLICABLE, not_applicable
from repro.run.pytest_cases import log_dir
from repro.vllm_integration.gate.judge import passes
from repro.vllm_integration.gate.methods import DEFAULT_METHOD
from repro.vllm_integration.gate.settings import settings  # noqa: F401  tests read it here too
from repro.vllm_integration.releases.builds import CONTROL, find_builds


def method_label(method: str) -> str:
    """The method's part of a test id: none for eagle (ids as recorded), else its name and a dash."""
    return "" if method == DEFAULT_METHOD else method.replace("_", "-") + "-"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The builds are looked for at collection (not at import): one test per build and mode."""
    if "gate_build" not in metafunc.fixturenames:
        return
    builds, given = find_builds(), settings()
    params = [
        pytest.param((b, m, builds, meth), id=f"{b.label}-{b.role}-{method_label(meth)}{m.label}")
        for b in builds
        for meth in given["methods"]
        for m in given["modes"]
    ]
    metafunc.parametrize("gate_build", params or [pytest.param(None, id="no-build")])


@pytest.mark.gpu
@pytest.mark.vllm
def test_stale_metadata_vllm_gate(gate_build, record_property):
    if gate_build is None:
        why = "no vLLM build named or installed (pip install vllm, or REPRO_VLLM / REPRO_VLLM_CONTROL=LABEL=PREFIX)"
        pytest.skip(not_applicable(why, "vllm", record_property))
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    from repro.vllm_integration.gate.cache import GateCache, default_root  # noqa: PLC0415  only with a GPU and vLLM
    from repro.vllm_integration.gate.outcome import control_of  # noqa: PLC0415  only with a GPU and vLLM
    from repro.vllm_integration.gate.run import run_gate  # noqa: PLC0415  only with a GPU and vLLM

    build, mode, builds, method = gate_build
    run = run_gate(
        builds,
        (mode,),
        log_dir() / "vllm-gate",
        jobs=2,
        timeout_s=settings()["timeout"],
        cache=GateCache(default_root()),
        self_control=settings()["self_control"],
        only=build,
        methods=(method,),
    )
    (case, res), *self_controls = sorted(run.cases, key=lambda cr: cr[0].inject is not None)
    for k in ("evidence", "kernel", "descriptor", "vllm_version", "wall_s"):
        record_property(k, getattr(res, k))
    record_property("role", build.role)
    record_property("method", method)
    control = control_of(case, res)
    for k, v in control.properties():  # what `pytest --gate` decides over, as `repro gate` sees it
        record_property(k, v)
    ident = res.backend_identity or {}
    record_property("engine", json.dumps(ident.get("engine"), default=str))
    record_property("counters", json.dumps(ident.get("counters"), default=str))
    record_property("acceptance", json.dumps(ident.get("acceptance"), default=str))
    record_property("self_control", json.dumps({c.case_id: r.verdict for c, r in self_controls}))
    if res.verdict == SKIP:  # a method the build lacks says so (control_of recorded it as not applicable)
        pytest.skip(NOT_APPLICABLE + why if (why := res.not_applicable) else res.reason)
    # the self control's forms judged as `repro gate` judges them (policy rules 1 and 6: in audit each form on its own,
    # outside it at least one form with kernel evidence, a silent form listed)
    judged = policy.decide([control_of(c, r) for c, r in self_controls])
    failed = [f for f in judged.failures if f.kind == CONTROL_FAILED]
    assert not failed, f"HARNESS BLIND: the self control of vLLM {build.label}: {failed[0]}"
    record_property("self_control_form_misses", json.dumps(judged.form_misses))
    if build.role == CONTROL:
        assert passes(case, res), f"HARNESS BLIND: control vLLM {build.label} came back {res.verdict}: {res.reason}"
        if policy.is_positive(control.expected) and not policy.counts_as_evidence(
            res.verdict, mode.policy_mode
        ):  # silent in this mode: rule 5 decides over its modes (a recorded memcheck case is no control to xfail)
            pytest.xfail(f"known-bad vLLM {build.label} silent in mode {mode.name} ({res.verdict}): policy rule 5 "
                         "judges it over its modes and methods (pytest --gate)")  # fmt: skip
    else:
        assert passes(case, res), f"vLLM {build.label} ({mode.name}): {res.verdict}: {res.reason}"
