"""Pins each pytest-xdist worker to its own GPU or MIG slice before anything initializes CUDA, gives each run its own
log folder and each process one case executor, and, for a gate run only (--gate / REPRO_GATE=1), registers the
strict gate's plugin (repro/report/pytest_gate.py GatePlugin: its hooks and state; the rule in
repro/judge/policy.py)."""

from __future__ import annotations

import os
import time

import pytest

from cases.gpu_env import gpu_skip_reason, mark_unrunnable
from repro.report import pytest_gate
from repro.run.pinning import apply_pin, choose_pin
from repro.run.pytest_cases import close_case_executor, start_run_logs, warm_up

# The gate's options (--gate, --gate-report, --gate-require): a plugin of their own, which pytest also loads from its
# entry point (pyproject.toml) before it picks its rootdir; named here for a checkout without `pip install -e .`.
pytest_plugins = ("repro.pytest_options",)


def pytest_configure(config):
    started = time.time()
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    apply_pin(choose_pin(worker, os.environ))
    start_run_logs(worker)
    if pytest_gate.enabled(config):  # as pytest-xdist registers its session: only when asked for
        try:
            pytest_gate.GatePlugin.register(config, gpu_skip_reason, started)
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Every value a case recorded leaves its process plain (pytest_gate.plain): pytest-xdist's serializer takes
    nothing else (a Verdict killed every worker at its first result), and the JUnit XML writes it as recorded."""
    outcome = yield
    report = outcome.get_result()
    report.user_properties = pytest_gate.plain_properties(report.user_properties)


def pytest_collection_modifyitems(config, items):
    runnable = mark_unrunnable(items)
    runs_cases = hasattr(config, "workerinput") or not config.getoption("numprocesses", default=None)
    specs = (i.callspec.params["spec"] for i in runnable if hasattr(i, "callspec") and "spec" in i.callspec.params)
    first = next(specs, None)
    if runs_cases and first is not None:  # an xdist controller runs no case: nothing to warm there
        warm_up(first)


def pytest_sessionfinish(session, exitstatus):
    close_case_executor()
