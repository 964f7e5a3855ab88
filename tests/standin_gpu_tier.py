"""Stand-ins for what the pytest GPU tier needs from a GPU machine, loaded into a real session of `cases/` with
`-p tests.standin_gpu_tier` (in the controller and in every xdist worker): the machine probe says a Hopper GPU with
both FA3 builds is there, and each case's process is replaced by a result whose verdict is one its expectation
accepts (the kinds taken in turn, so a session holds every kind), or the one STANDIN_VERDICTS names for it
("CASE_ID_PART=VERDICT,..."). Everything else is the tier's own: conftest.py, cases/controls.py, the gate plugin,
pytest-xdist, the JUnit XML. MIG, MPS and memcheck cases stay not applicable, as on a CPU machine."""

from __future__ import annotations

import os
import zlib

VERDICTS_ENV = "STANDIN_VERDICTS"


def probe() -> dict:
    return {"sms": 132, "capability": [9, 0], "upstream": None, "vllm": None}


def run_case(spec, log_dir, mps, executor):
    from repro.case.spec import CaseResult
    from repro.contract.verdicts import CRASH, OOB, STALE_AUDIT, Verdict
    from repro.judge.expectations import expectation
    from repro.judge.policy import MEETS

    accepted = MEETS[expectation(spec)]
    verdict = accepted[zlib.crc32(spec.case_id.encode()) % len(accepted)]
    for rule in filter(None, os.environ.get(VERDICTS_ENV, "").split(",")):
        part, _, named = rule.partition("=")
        if part in spec.case_id:
            verdict = Verdict(named)
    return CaseResult(
        spec.case_id,
        verdict,
        f"stand-in {verdict}",
        kernel="combine" if verdict in (OOB, CRASH) else None,
        descriptor="t1r1",
        stale_fields={"seq_lens": 1} if verdict == STALE_AUDIT else {},
        wall_s=0.01,
        gpu_uuid="GPU-standin-" + os.environ.get("PYTEST_XDIST_WORKER", "main"),
        evidence=f"stand-in {verdict}",
    )


def pytest_configure(config):
    import cases.controls
    import cases.gpu_env

    cases.gpu_env.probe = probe
    cases.controls.run_case = run_case
