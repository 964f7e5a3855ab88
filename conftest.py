"""Pins each pytest-xdist worker to its own GPU or MIG slice before anything initializes CUDA, gives each run its own
log folder and each process one case executor, and applies the strict gate (--gate / REPRO_GATE=1; logic in
repro/report/pytest_gate.py, the rule in repro/judge/policy.py)."""

from __future__ import annotations

import os
import time

import pytest

from cases.gpu_env import gpu_skip_reason, mark_unrunnable
from repro import exit_codes
from repro.report import pytest_gate
from repro.run.pinning import apply_pin, choose_pin
from repro.run.pytest_cases import close_case_executor, start_run_logs, warm_up

_evidence: pytest_gate.Evidence | None = None  # set in a gate run


# The gate's options (--gate, --gate-report, --gate-require): a plugin of their own, which pytest also loads from its
# entry point (pyproject.toml) before it picks its rootdir; named here for a checkout without `pip install -e .`.
pytest_plugins = ("repro.pytest_options",)


def pytest_configure(config):
    config._repro_t0 = time.time()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    pin = choose_pin(worker, os.environ)
    apply_pin(pin)
    config._repro_pin = pin
    start_run_logs(worker)
    global _evidence
    if pytest_gate.enabled(config):
        try:
            needed = pytest_gate.required(config)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        os.environ[pytest_gate.ENV] = "1"  # the cases (and xdist workers) read it
        config._repro_required = needed
        _evidence = pytest_gate.Evidence(needed)


def pytest_sessionstart(session):
    """A gate run on a machine where no GPU case can run stops here with one line (before xdist starts workers),
    instead of one error block per case."""
    if _evidence is not None and not hasattr(session.config, "workerinput"):
        if why := gpu_skip_reason():
            pytest.exit(pytest_gate.no_gpu_line(why), returncode=pytest.ExitCode(exit_codes.gate_decision(False)))


def pytest_collection_modifyitems(config, items):
    runnable = mark_unrunnable(items)
    runs_cases = hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None)
    specs = (i.callspec.params["spec"] for i in runnable if hasattr(i, "callspec") and "spec" in i.callspec.params)
    first = next(specs, None)
    if runs_cases and first is not None:  # an xdist controller runs no case: nothing to warm there
        warm_up(first)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if pytest_gate.enabled(item.config):
        pytest_gate.skipped_to_failure(item, outcome.get_result(), getattr(item.config, "_repro_required", frozenset()))


def pytest_runtest_logreport(report):
    if _evidence is not None:
        _evidence.add(report)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _evidence is None or hasattr(config, "workerinput"):
        return
    lines, why = _evidence.summary()
    terminalreporter.section("repro gate")
    for line in lines:
        terminalreporter.line(line)
    if why:
        terminalreporter.line(why, red=True)


def pytest_sessionfinish(session, exitstatus):
    close_case_executor()
    if _evidence is None or hasattr(session.config, "workerinput"):
        return  # not a gate run, or an xdist worker (the controller decides)
    _, why = _evidence.summary()
    session.exitstatus = pytest.ExitCode(exit_codes.pytest_session(session.exitstatus, gate_passed=why is None))
    if session.config.getoption("gate_report"):
        config = session.config
        _evidence.write_report(
            config.getoption("gate_report"), time.time() - config._repro_t0, list(config.invocation_params.args)
        )
