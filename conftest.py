"""Pins each pytest-xdist worker to its own GPU or MIG slice before anything initializes CUDA, records verdicts as
JUnit properties, and applies the strict gate (--gate / REPRO_GATE=1, logic in repro/pytest_gate.py)."""

from __future__ import annotations

import os

import pytest

from repro import pytest_gate
from repro.pinning import apply_pin, choose_pin

_evidence: pytest_gate.Evidence | None = None  # set in a gate run


def pytest_addoption(parser):
    parser.addoption("--gate", action="store_true", help="strict gate: skipped GPU cases and missing evidence fail")


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    pin = choose_pin(worker, os.environ)
    apply_pin(pin)
    config._repro_pin = pin
    global _evidence
    if pytest_gate.enabled(config):
        os.environ[pytest_gate.ENV] = "1"  # the cases (and xdist workers) read it
        _evidence = pytest_gate.Evidence()


def pytest_collection_modifyitems(config, items):
    from cases.gpu_env import mark_unrunnable

    mark_unrunnable(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if pytest_gate.enabled(item.config):
        pytest_gate.skipped_to_failure(item, outcome.get_result())


def pytest_runtest_logreport(report):
    if _evidence is not None:
        _evidence.add(report)


def pytest_sessionfinish(session, exitstatus):
    if _evidence is None or hasattr(session.config, "workerinput"):
        return  # not a gate run, or an xdist worker (the controller decides)
    why = _evidence.failure()
    if why:
        session.config.get_terminal_writer().line(why, red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
