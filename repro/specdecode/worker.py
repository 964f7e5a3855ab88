"""Runs ONE spec-decode case inside its own process: `python -m repro.specdecode.worker SPEC` (the runner starts it
for a case of the spec-decode scenario, repro.case.scenarios.SPEC; every other scenario runs in
repro.attention.worker). The process around the case (torch, the device record, a skip, the RESULT record, the
phases) is the attention worker's own `main`, given this module's `run_case`: the spec-decode layer sits above the
attention layer, so it imports the worker, never the other way round."""

from __future__ import annotations

import sys

from repro.attention import worker
from repro.backends import load_backend
from repro.case.poison import parse_poison
from repro.case.scenarios import SPEC
from repro.case.spec import CaseSpec
from repro.contract.channel import emit
from repro.contract.tags import PASS_TAG
from repro.specdecode.case import run_spec_case


def run_case(spec: CaseSpec) -> dict:
    """The spec-decode case (repro.specdecode.case.run_spec_case) on this process's device and SM configuration."""
    import torch  # main imported (and timed) it before this runs: bound here, the module loads without torch

    if spec.scenario != SPEC:
        raise ValueError(f"{spec.scenario!r} is not the spec-decode scenario: repro.attention.worker runs it")
    torch.manual_seed(spec.seed)
    reported, margin, _green = worker.sm_setup(spec, torch)
    backend = load_backend(spec.backend, spec.backend_path)
    res = run_spec_case(spec, backend, margin, parse_poison(spec.poison), lambda ev: emit(PASS_TAG, ev))
    res.update(sms_reported=reported, sms_planned=reported - margin, backend_identity=backend.identity().to_dict())
    return res


def main(argv: list[str] | None = None) -> int:
    return worker.main(argv, run=run_case)


if __name__ == "__main__":
    sys.exit(main())
