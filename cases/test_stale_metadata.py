"""GPU cases: FA3 x scenario x strategy x SM restriction x mode, each in its own process under a timeout.

Positive controls (stale) must be detected, negative controls (fresh) must be clean. A positive control that
comes back clean FAILS with "harness blind": this environment cannot see the bug, and passing would lie."""

from __future__ import annotations

import pytest

from cases.controls import run_control
from repro.case import CaseSpec, SmConfig
from repro.descriptors import AttnConfig

BACKENDS = [pytest.param(b, id=b) for b in ("vllm", "upstream")]
STRATEGIES = [pytest.param("stale", id="stale"), pytest.param("fresh", id="fresh")]
SMS = [
    pytest.param("sm_margin:16", id="smmargin16"),
    pytest.param("full", id="sm-all"),
    pytest.param("mps:16", id="mps16", marks=pytest.mark.mps),
    pytest.param("mig", id="mig", marks=pytest.mark.mig),
]
MODES = [pytest.param("eager", id="eager"), pytest.param("graph", id="graph")]
SPLITS = [pytest.param(32, id="splits32"), pytest.param(0, id="splits0")]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sm", SMS)
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_metadata_v2_capture(backend, strategy, sm, mode, splits, record_property):
    """vLLM V2 capture order; poisoned padding (int-max) makes stale outcomes repeatable."""
    spec = CaseSpec(
        backend,
        strategy,
        mode,
        sm=SmConfig.parse(sm),
        cfg=AttnConfig(num_splits=splits),
        poison="int-max",
        timeout_s=120,
    )
    run_control(spec, record_property)


@pytest.mark.gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_stale_metadata_memcheck_16sm(backend, strategy, record_property):
    """Unpoisoned, FA3's split heuristic at 16 SMs: memcheck names the faulting kernel (combine for upstream)."""
    spec = CaseSpec(
        backend,
        strategy,
        "eager",
        sm=SmConfig.parse("sm_margin:16"),
        cfg=AttnConfig(num_splits=0),
        sanitizer=True,
        timeout_s=180,
    )
    run_control(spec, record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_stale_metadata_pair(strategy, record_property):
    """Metadata built for one request, launched for eight."""
    spec = CaseSpec(
        "vllm",
        strategy,
        "eager",
        scenario="pair",
        pair=("t4r1", "t32r8"),
        poison="int-max",
        sm=SmConfig.parse("sm_margin:16"),
        timeout_s=120,
    )
    run_control(spec, record_property)
