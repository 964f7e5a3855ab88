"""Every report renders every verdict (issue: `matrix --out` crashed in the heatmap on `launch-failure`), and the
launch failures measured on the H200 (results/h200-launch-failures) are classified, attributed and expected."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from repro.case.spec import CaseSpec
from repro.contract.verdicts import ERROR, LAUNCH_FAIL, VERDICTS
from repro.judge.classify import classify
from repro.judge.control import Control, GatingMode
from repro.judge.policy import decide, satisfies
from repro.report import results as report
from repro.run.matrix import MatrixRun
from tests.records import RESULTS

ROOT = Path(__file__).resolve().parent.parent
SWEEP = RESULTS / "h200-launch-failures"
SWEEP2 = RESULTS / "h200-launch-failures-2"  # the same sweep after the exit-status fix


def _one_of_each() -> MatrixRun:
    """The recorded sweep run (crash, launch-failure, clean, error), plus a row for every other verdict."""
    run = report.load_json(SWEEP / "k5-page16" / "results.json")
    have = {r.verdict for _, r in run.results}
    s0, r0 = run.results[0]
    for v in VERDICTS:
        if v not in have:
            spec = dataclasses.replace(s0, seed=VERDICTS.index(v) + 1)
            run.results.append((spec, dataclasses.replace(r0, case_id=spec.case_id, verdict=v, reason=f"a {v} row")))
    return run


def test_every_report_renders_every_verdict(tmp_path):
    run = _one_of_each()
    assert {r.verdict for _, r in run.results} == set(VERDICTS)
    md = report.markdown(run)
    for v in VERDICTS:
        assert f"**{v}**" in md
    report.write_json(run, tmp_path / "r.json")
    again = report.load_json(tmp_path / "r.json")
    assert [r.verdict for _, r in again.results] == [r.verdict for _, r in run.results]
    assert [r.expected for _, r in again.results] == [r.expected for _, r in run.results]
    pytest.importorskip("matplotlib")
    assert report.heatmap(run, tmp_path / "h.png") and (tmp_path / "h.png").stat().st_size > 0
    assert set(report.VERDICT_COLORS) == set(VERDICTS)


def test_gate_report_renders_every_verdict(tmp_path, monkeypatch):
    from repro.report import pytest_gate

    monkeypatch.setattr("repro.report.environment.collect", lambda argv=None: {"command": "test"})
    ev = pytest_gate.Evidence()
    ev.controls = [Control(f"case-{v}", "detected", v, GatingMode("eager"), f"a {v} row") for v in VERDICTS]
    ev.write_report(tmp_path, 1.0, ["-m", "gpu", "--gate", "--gate-report=out"])  # pytest's args, as typed
    md = (tmp_path / "gate.md").read_text()
    assert all(f"**{v}**" in md for v in VERDICTS)
    assert "| command | python -m pytest -m gpu --gate --gate-report=out |" in md  # not `python -m repro <pytest>`
    assert json.loads((tmp_path / "gate.json").read_text())["passed"] is False


def test_recorded_launch_failures_are_classified_from_their_faulting_line():
    run = report.load_json(SWEEP / "k7-page64" / "results.json")
    launch = [(s, r) for s, r in run.results if r.verdict == LAUNCH_FAIL]
    assert len(launch) == 8 and all(s.backend == "upstream" and s.strategy == "stale" for s, _ in launch)
    for s, _ in launch:
        log = SWEEP / "k7-page64" / "logs" / f"{s.case_id}.out.log"
        again = classify(s, log.read_text(), 1, False, None, 1.0)
        assert again.verdict == LAUNCH_FAIL and again.kernel == "combine", again.reason
        assert "flash_fwd_combine_launch_template.h" in again.reason


@pytest.mark.parametrize("run_name", sorted(p.parent.name for p in SWEEP.glob("*/results.json")))
def test_recorded_sweep_meets_its_stored_expectations(run_name):
    """Launch failures meet the stale eager controls' `fault` (the kernels failed); the only misses are the two clean
    cases whose exit status the forkserver lost (exit 255 after the result: repro.run.process.exit_code, fixed since)."""
    run = report.load_json(SWEEP / run_name / "results.json")
    misses = run.failures()
    assert all(r.verdict == ERROR and "exit status 255" in r.reason and s.strategy == "fresh" for s, r in misses)
    assert len(misses) == (1 if run_name in ("k5-page16", "k7-page16") else 0)
    assert all(satisfies(r.expected, r.verdict) for s, r in run.results if r.verdict == LAUNCH_FAIL)
    controls = [Control(s.case_id, r.expected, r.verdict, GatingMode(s.mode), r.reason) for s, r in run.results if r not in
                [m for _, m in misses]]  # fmt: skip
    assert decide(controls).passed


@pytest.mark.parametrize("run_name", sorted(p.parent.name for p in SWEEP2.glob("*/results.json")))
def test_second_sweep_passes_a_gate_with_its_hang_as_a_disagreement(run_name):
    """After the exit-status fix: no harness error; one stale vLLM-fork case hung where the model expected a fault:
    kernel evidence (the gate passes) of another kind (listed as a disagreement, `matrix` counts it unexpected)."""
    run = report.load_json(SWEEP2 / run_name / "results.json")
    assert not [r for _, r in run.results if r.verdict == ERROR]
    d = decide([Control(s.case_id, r.expected, r.verdict, GatingMode(s.mode), r.reason) for s, r in run.results])
    assert d.passed, d.failures
    hangs = [(s, r) for s, r in run.results if r.verdict == "hang"]
    assert len(d.disagreements) == len(hangs) == len(run.failures()) == (1 if run_name == "k5-page64" else 0)
    for s, _ in hangs:
        assert s.strategy == "stale" and s.backend == "vllm"


def test_kernel_comes_from_the_faulting_line_only():
    spec = CaseSpec("upstream", "stale")
    out = "loading flash_fwd_combine kernels\nRuntimeError: CUDA error: an illegal memory access was encountered\n"
    res = classify(spec, out, 1, False, None, 1.0)
    assert res.verdict == "crash" and res.kernel is None  # "combine" elsewhere in the log names nothing
    row = report.rows(MatrixRun([(spec, res)], 1.0, None))[0]
    assert row["kernel"] == report.NOT_ATTRIBUTED
    ulf = classify(spec, "RuntimeError: CUDA error: unspecified launch failure\n", 1, False, None, 1.0)
    code = classify(spec, "cudaErrorLaunchFailure in flash_fwd_combine\n", 1, False, None, 1.0)
    assert ulf.verdict == code.verdict == "crash" and code.kernel == "combine"  # one CUDA error, one verdict
