"""The pytest GPU tier's variables (REPRO_GATE_MODES, REPRO_GATE_METHODS, REPRO_GATE_TIMEOUT, REPRO_SELF_CONTROL),
judged in one place: at collection by cases/test_vllm_gate.py, and before any case runs by `pytest --gate`
(repro.pytest_options), each error naming its variable (bad input, exit 2, never "GATE FAILED: no GPU")."""

from __future__ import annotations

import os

from repro.errors import ConfigError
from repro.run.process import MAX_WAIT_S
from repro.vllm_integration.gate.case import SELF_CONTROL_CHOICES
from repro.vllm_integration.gate.methods import DEFAULT_METHODS, parse_methods
from repro.vllm_integration.gate.modes import DEFAULT_MODES, parse_modes

SELF_CONTROL_ENV = "REPRO_SELF_CONTROL"
METHODS_ENV = "REPRO_GATE_METHODS"  # speculative methods (gate.methods): all (default), or eagle, eagle3, draft_model, mtp, dflash
TIMEOUT_ENV = "REPRO_GATE_TIMEOUT"
MODES_ENV = "REPRO_GATE_MODES"


def _timeout(text: str) -> float:
    value = float(text)  # ValueError for no number
    if not 0 < value <= MAX_WAIT_S:  # nan too
        raise ValueError(f"a number of seconds, more than 0 and at most {MAX_WAIT_S} (a week)")
    return value


def _self_control(text: str) -> str:
    if text not in SELF_CONTROL_CHOICES:
        raise ValueError(f"use {', '.join(SELF_CONTROL_CHOICES)}")
    return text


def settings(environ=os.environ) -> dict:
    """The tier's variables, each error naming its variable (ConfigError): a bad one read only in a running test
    would let a CPU run pass over it and fail every test of a GPU run with a traceback (a timeout past a week:
    Python's waits overflow)."""
    out = {}
    for key, var, parse, default in (
        ("modes", MODES_ENV, parse_modes, ",".join(DEFAULT_MODES)),
        ("methods", METHODS_ENV, parse_methods, DEFAULT_METHODS),
        ("timeout", TIMEOUT_ENV, _timeout, "300"),
        ("self_control", SELF_CONTROL_ENV, _self_control, "under-test"),
    ):
        text = environ.get(var, default)
        try:
            out[key] = parse(text)
        except (ConfigError, ValueError) as e:
            raise ConfigError(f"{var}={text!r}: {e}") from None
    return out
