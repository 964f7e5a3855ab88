"""Reports rendered from runs recorded on the H200, and the expectation rules."""

from pathlib import Path

import pytest

from repro import report
from repro.case import CLEAN, CRASH, OOB, WRONG, CaseSpec, SmConfig
from repro.descriptors import AttnConfig
from repro.matrix import MatrixOptions, build_specs, expectation, meets

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


def test_expectations():
    assert expectation(_spec()) == "fault"
    assert expectation(_spec(sm=SmConfig("full"))) == "detected"
    assert expectation(_spec(poison=None)) == "detected"
    assert expectation(_spec(cfg=AttnConfig(num_splits=0))) == "detected"
    assert expectation(_spec(strategy="fresh")) == "clean"
    assert meets("fault", CRASH) and meets("fault", OOB) and not meets("fault", WRONG)
    assert meets("detected", WRONG) and not meets("detected", CLEAN)
    assert meets("clean", CLEAN) and not meets("clean", OOB)
    assert meets("clean", "skip") is None


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
