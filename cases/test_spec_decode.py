"""GPU cases with real models: a Llama-style target and an EAGLE draft captured like vLLM's V2 runner, then greedy
speculative decoding with graph replay. Stale (the draft prefill reuses the target's attention states) must be seen
(a fault, or the capture audit); fresh must fault nowhere and give tokens equal to an eager run. The configurations:
a pairwise covering set (repro/case/sets.py; REPRO_SPEC_SWEEP=full for the whole cross product)."""

from __future__ import annotations

import pytest

from cases.controls import run_control
from repro.case import sets as case_sets


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("spec", case_sets.params(case_sets.spec_decode()))
def test_stale_metadata_spec_decode(spec, record_property):
    run_control(spec, record_property)
