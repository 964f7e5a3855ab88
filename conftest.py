"""Pins each pytest-xdist worker to its own GPU or MIG slice before anything initializes CUDA, and records verdicts
as JUnit properties."""

from __future__ import annotations

import os

from repro.pinning import apply_pin, choose_pin


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    pin = choose_pin(worker, os.environ)
    apply_pin(pin)
    config._repro_pin = pin
