"""Reports rendered from runs recorded on the H200, and the expectation rules."""

from pathlib import Path

import pytest

from repro import report
from repro.case import CaseSpec, SmConfig
from repro.matrix import MatrixOptions, build_specs, expectation
from repro.report import load_json
from repro.verdicts import CLEAN, CRASH, HANG, LAUNCH_FAIL, OOB, STALE_AUDIT, WRONG, satisfies

RESULTS = Path(__file__).parent.parent / "results"


def test_recorded_benchmark_renders(tmp_path):
    run = report.load_json(RESULTS / "h200-memcheck-benchmark" / "results.json")
    assert len(run.results) == 48
    md = report.markdown(run, {"gpu": "NVIDIA H200"})
    assert "| gpu | NVIDIA H200 |" in md
    assert "48 cases in" in md and "0 unexpected" in md
    assert "FlashAttnFwdSm90" in md
    out = tmp_path / "r.json"
    report.write_json(run, out, {"gpu": "x"})
    again = report.load_json(out)
    assert [r.verdict for _, r in again.results] == [r.verdict for _, r in run.results]


def test_heatmap_png(tmp_path):
    pytest.importorskip("matplotlib")
    run = report.load_json(RESULTS / "h200-default" / "results.json")
    assert report.heatmap(run, tmp_path / "h.png")
    assert (tmp_path / "h.png").read_bytes()[:4] == b"\x89PNG"


def test_failures_and_blind_controls_are_found():
    run = report.load_json(RESULTS / "h200-nopoison" / "results.json")
    assert run.failures() == []
    s, r = run.results[0]
    assert expectation(s) != "clean"
    r.verdict = CLEAN  # what a blind harness would report
    assert run.blind_controls() == [(s, r)]


def _spec(**kw):
    base = dict(backend="vllm", strategy="stale", mode="eager", sm=SmConfig("sm_margin", 16), poison="int-max")
    base.update(kw)
    return CaseSpec(**base)


def test_expectations_come_from_the_model_or_a_measured_table():
    assert expectation(_spec()) == "fault"  # model: main-kernel read far out of bounds (int-max)
    assert expectation(_spec(sm=SmConfig("full"))) == "fault"  # crashed at 132 SMs too (h200-poison-repeats)
    assert expectation(_spec(mode="graph")) == "detected"  # the model predicts eager warmups: no fault claim
    assert expectation(_spec(poison=None)) == "detected"  # model: wrong output (the caching allocator hides it)
    assert expectation(_spec(sm=SmConfig("green", 16))) == "audit"  # not modelled, not measured with int-max
    assert expectation(_spec(sm=SmConfig("green", 16), poison=None)) == "detected"  # measured (h200-green)
    assert expectation(_spec(sm=SmConfig("mig"))) == "audit"  # never measured here: no claim
    assert expectation(_spec(scenario="spec-decode", poison=None)) == "audit"  # h200-spec-nopoison
    assert expectation(_spec(strategy="fresh")) == "clean"
    assert not satisfies("fault", HANG) and satisfies("detected", HANG)  # a hang is not a memory fault
    assert satisfies("detected", LAUNCH_FAIL) and not satisfies("detected", STALE_AUDIT)
    assert satisfies("audit", STALE_AUDIT)


RECORDED = sorted(p for p in (Path(__file__).resolve().parent.parent / "results").glob("h200-*/results.json"))


def test_every_recorded_gpu_run_meets_its_expectation():
    """The expectations (model + measured table) against every recorded matrix run; h200-memcheck-nostop is left
    out: recorded before the runner stopped cases after memcheck's first finding, its faults show up as hangs."""
    checked = 0
    for path in RECORDED:
        if path.parent.name == "h200-memcheck-nostop":
            continue
        for s, r in load_json(path).results:
            assert satisfies(expectation(s), r.verdict) is not False, (path.parent.name, s.case_id, r.verdict)
            checked += 1
    assert checked > 200
    assert satisfies("fault", CRASH) and satisfies("fault", OOB) and not satisfies("fault", WRONG)
    assert satisfies("detected", WRONG) and not satisfies("detected", CLEAN)
    assert satisfies("clean", CLEAN) and not satisfies("clean", OOB)
    assert satisfies("clean", "skip") is None


def test_build_specs_repeats_and_orders():
    specs = build_specs(MatrixOptions(backends=("vllm",), sms=("full",), modes=("eager",), splits=(32,), repeat=3))
    assert [s.rep for s in specs] == [0, 1, 2, 0, 1, 2]
    assert specs[0].strategy == "stale" and specs[-1].strategy == "fresh"
    assert specs[1].case_id.endswith("-rep1")
    assert len({s.case_id for s in specs}) == 6


def test_skipped_results_reload_from_json(tmp_path):
    from repro.case import CaseResult
    from repro.matrix import MatrixRun

    spec = _spec(sm=SmConfig("mps", 16))
    report.write_json(MatrixRun([(spec, CaseResult.skipped(spec, "no MPS"))], 1.0, None), tmp_path / "r.json")
    ((s, r),) = report.load_json(tmp_path / "r.json").results
    assert s == spec and r.verdict == "skip" and r.reason == "no MPS"
