"""The strict gate (--gate): on a machine without a GPU the GPU tier must fail, not pass; without --gate it skips."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

from repro import pytest_gate

ROOT = Path(__file__).resolve().parent.parent


def _pytest(*args):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", "-k", "stale_metadata and pair"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=600, cwd=ROOT)


def test_gate_fails_where_the_gpu_tier_only_skips():
    plain = _pytest()
    assert plain.returncode == 0 and "skipped" in plain.stdout
    gate = _pytest("--gate")
    assert gate.returncode == 1
    assert "GATE FAILED: no positive control produced kernel evidence" in gate.stdout
    assert "could not run here" in gate.stdout


def _report(verdict, expected, when="call"):
    return types.SimpleNamespace(when=when, user_properties=[("verdict", verdict), ("expected", expected)])


def test_evidence_needs_a_positive_control_with_kernel_evidence():
    ev = pytest_gate.Evidence()
    for r in (_report("stale-audit", "detected"), _report("clean", "clean"), _report("crash", "fault", "setup")):
        ev.add(r)
    assert ev.controls == 1 and ev.failure()  # the audit alone is not evidence from a kernel
    ev.add(_report("wrong-output", "detected"))
    assert ev.failure() is None
