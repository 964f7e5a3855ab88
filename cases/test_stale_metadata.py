"""GPU cases at the attention layer: FA3 x scenario x strategy x SM restriction x mode, each in its own process under
a timeout (the sets: repro/case/sets.py). Positive controls (stale) must be detected, negative controls (fresh) must
be clean. A positive control that comes back clean FAILS with "harness blind": this environment cannot see the bug,
and passing would lie. MIG, MPS and memcheck cases are "not applicable" where the runner cannot have them."""

from __future__ import annotations

import pytest

from cases.controls import run_control
from repro.case import sets as case_sets


def _marks(spec):
    return [m for kind, m in (("mps", pytest.mark.mps), ("mig", pytest.mark.mig)) if spec.sm.kind == kind]


V2_CAPTURE = [
    pytest.param(*p.values, id=p.id, marks=_marks(p.values[0])) for p in case_sets.params(case_sets.v2_capture())
]


@pytest.mark.gpu
@pytest.mark.parametrize("spec", V2_CAPTURE)
def test_stale_metadata_v2_capture(spec, record_property):
    """vLLM V2 capture order; poisoned padding (int-max) makes stale outcomes repeatable."""
    run_control(spec, record_property)


@pytest.mark.gpu
@pytest.mark.sanitizer
@pytest.mark.parametrize("spec", case_sets.params(case_sets.memcheck()))
def test_stale_metadata_memcheck_16sm(spec, record_property):
    """Unpoisoned, FA3's split heuristic at 16 SMs: memcheck names the faulting kernel (combine for upstream)."""
    run_control(spec, record_property)


@pytest.mark.gpu
@pytest.mark.parametrize("spec", case_sets.params(case_sets.pair()))
def test_stale_metadata_pair(spec, record_property):
    """Metadata built for one request, launched for eight."""
    run_control(spec, record_property)
