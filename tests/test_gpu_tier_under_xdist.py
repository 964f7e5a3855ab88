"""The pytest GPU tier's own plumbing (conftest.py, cases/controls.py, the gate plugin, the JUnit XML) run through
pytest-xdist as the README's CI line runs it, on a CPU: only the machine probe and each case's process are stand-ins
(tests/standin_gpu_tier.py). A value a case records that xdist cannot carry (a Verdict once did: every
worker died at its first result) fails here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from repro.contract.verdicts import Verdict
from repro.judge.control import Control
from repro.report.pytest_gate import plain

ROOT = Path(__file__).resolve().parent.parent
KINDS = {"clean", "oob", "crash", "hang", "wrong-output", "launch-failure"}


def _tier(tmp_path: Path, name: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, dict, dict]:
    """One session of the GPU tier's CI line; (the process, gate.json, {case: JUnit properties})."""
    out, xml = tmp_path / name, tmp_path / f"{name}.xml"
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "REPRO_", "STANDIN_"))}
    full = {**base, "PYTHONPATH": str(ROOT), "REPRO_EXECUTOR": "process", "REPRO_LOG_DIR": str(tmp_path), **env}
    cmd = [sys.executable, "-m", "pytest", "cases", "-m", "gpu", "-k", "stale_metadata", "--gate", "-q"]
    cmd += ["-p", "tests.standin_gpu_tier", "-p", "no:cacheprovider", f"--junitxml={xml}", *args]
    cmd += ["--gate-report", str(out)] if "-n" in args else [f"--gate-report={out}"]  # both forms of the option
    r = subprocess.run(cmd, cwd=ROOT, env=full, capture_output=True, text=True, timeout=600)
    assert (out / "gate.json").exists(), r.stdout[-3000:] + r.stderr[-2000:]
    cases = {}
    for tc in ET.parse(xml).getroot().iter("testcase"):
        cases[tc.get("name")] = {p.get("name"): p.get("value") for p in tc.iter("property")}
    return r, json.loads((out / "gate.json").read_text()), cases


# under xdist, every test reading it runs on one worker (conftest's SHARED_FIXTURE): it runs once
@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tier")
    return {
        "xdist": _tier(tmp, "xdist", "-n", "2"),
        "serial": _tier(tmp, "serial"),
        "failing": _tier(
            tmp, "failing", "-n", "2", STANDIN_VERDICTS="vllm-pair-fresh=cannot-vouch,vllm-pair-stale=clean"
        ),
    }


def test_every_verdict_kind_crosses_xdist_into_the_gate_report_and_the_junit_xml(sessions):
    r, gate, cases = sessions["xdist"]
    assert r.returncode == 0, r.stdout[-3000:]
    assert "INTERNALERROR" not in r.stdout + r.stderr and "GATE FAILED" not in r.stdout
    assert gate["outcome"] == "GATE PASSED" and gate["passed"] is True
    verdicts = {c["verdict"] for c in gate["controls"] if not c["not_applicable"]}
    assert KINDS <= verdicts, verdicts
    assert {c["needs"] for c in gate["controls"] if c["not_applicable"]} >= {"mps", "mig", "sanitizer", "vllm"}
    recorded = {p["verdict"] for p in cases.values() if "verdict" in p}
    assert recorded == verdicts and recorded <= {v.value for v in Verdict}  # "crash", never "Verdict.CRASH"
    assert {p["xdist_worker"] for p in cases.values() if "xdist_worker" in p} == {"gw0", "gw1"}


def test_the_verdicts_are_the_same_with_and_without_xdist(sessions):
    (_, many, _), (r, one, _) = sessions["xdist"], sessions["serial"]
    assert r.returncode == 0, r.stdout[-3000:]
    assert {c["case_id"]: c["verdict"] for c in many["controls"]} == {
        c["case_id"]: c["verdict"] for c in one["controls"]
    }


def test_a_cannot_vouch_and_a_blind_positive_fail_the_gate_under_xdist(sessions):
    r, gate, cases = sessions["failing"]
    assert r.returncode == 1 and gate["passed"] is False, r.stdout[-3000:]
    failures = " ".join(gate["failures"])
    assert "vllm-pair-fresh" in failures and "vllm-pair-stale" in failures, failures
    assert any(p.get("verdict") == "cannot-vouch" for p in cases.values())
    assert "GATE FAILED" in r.stdout


def test_recorded_values_are_made_plain_and_read_back_typed():
    class Kind(Verdict.__base__):  # a str enum of the project's kind
        A = "a"

    value = {"v": Verdict.CRASH, "k": (Kind.A, 1.5, None), "s": {2, 1}, "p": Path("x")}
    assert plain(value) == {"v": "crash", "k": ["a", 1.5, None], "s": [1, 2], "p": "x"}
    assert type(plain(Verdict.CRASH)) is str and json.dumps(plain(value))

    control = Control.from_properties("c", {"verdict": "oob", "expected": "fault"})
    assert control.verdict is Verdict.OOB
    assert Control.from_properties("c", {"verdict": "nonsense"}).verdict is Verdict.ERROR
