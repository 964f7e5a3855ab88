"""Reports rendered from runs recorded on the H200, and the expectation rules."""

from pathlib import Path

import pytest

from repro import report
from repro.case import CaseSpec, SmConfig
from repro.expectations import expectation
from repro.matrix import MatrixOptions, build_specs
from repro.policy import satisfies
from repro.report import load_json
from repro.verdicts import CLEAN, CRASH, HANG, LAUNCH_FAIL, OOB, STALE_AUDIT, WRONG

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


RECORDED = sorted(
    p
    for pattern in ("h200-*/results.json", "h200-*/old/results.json", "h200-*/new/results.json")
    for p in (Path(__file__).resolve().parent.parent / "results").glob(pattern)
)


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


def test_recorded_execution_paths_agree_and_the_new_one_is_faster():
    """results/h200-executors and h200-memcheck-executors: both paths in one command on the H200; the same verdicts,
    the new path's wall time lower, its crashed first positive control split into start-up phases."""
    from repro.benchmark import summarize

    for name in ("h200-executors", "h200-memcheck-executors", "h200-memcheck-warm", "h200-executors-served"):
        old, new = (load_json(RESULTS / name / p / "results.json") for p in ("old", "new"))
        assert [(s.case_id, r.verdict) for s, r in old.results] == [(s.case_id, r.verdict) for s, r in new.results]
        assert new.wall_s < old.wall_s and summarize(new)["phases_mean_s"]["import_s"] >= 0
        first = next(r for s, r in new.results if s.case_id == new.first_positive_case)
        assert set(first.phases) == {"start_s", "import_s", "cuda_init_s", "rest_s"}
    plain_new = load_json(RESULTS / "h200-executors" / "new" / "results.json")
    assert plain_new.wall_s < 30 and summarize(plain_new)["phases_mean_s"]["import_s"] == 0.0  # forked: no import


def test_recorded_memcheck_processes_started_ahead():
    """results/h200-memcheck-warm: memcheck cases in processes started ahead of them (WarmPool), stopped once their
    first error was written whole, the MPS server never refusing a client (memcheck destroys the faulting context):
    48 cases in under 60 s, no MPS case rerun or refused, the verdicts and kernels of the old path."""
    old, new = (load_json(RESULTS / "h200-memcheck-warm" / p / "results.json") for p in ("old", "new"))
    assert new.wall_s < 60 < old.wall_s and new.failures() == []
    assert [(s.case_id, r.verdict, r.kernel) for s, r in old.results] == [
        (s.case_id, r.verdict, r.kernel) for s, r in new.results
    ]
    assert not any("rerun alone" in r.reason or "refusal" in r.reason for _, r in new.results)
    stale = [r for s, r in new.results if s.strategy == "stale"]
    assert len(stale) == 24 and all("after memcheck's first complete finding" in r.reason for r in stale)
    waited = [r.phases["start_s"] for _, r in new.results if r.phases]
    assert max(waited) > 1 and min(waited) < 0.1  # the first ones waited for their imports, later ones found them done


def test_recorded_served_path_shows_the_first_verdict_within_3_s():
    """results/h200-executors-served: three paths in one command; results/h200-default-served and -cold: the first
    positive control counted from the command's start, with and without a repro server running."""
    runs = {p: load_json(RESULTS / "h200-executors-served" / p / "results.json") for p in ("old", "new", "served")}
    verdicts = {p: [(s.case_id, r.verdict) for s, r in run.results] for p, run in runs.items()}
    assert verdicts["old"] == verdicts["new"] == verdicts["served"]
    assert runs["served"].first_positive_s < 3 < runs["new"].first_positive_s < runs["old"].first_positive_s
    assert runs["served"].wall_s < runs["new"].wall_s < 30
    served, cold = (load_json(RESULTS / f"h200-default-{p}" / "results.json") for p in ("served", "cold"))
    assert served.first_positive_s + served.setup_s < 3 < cold.first_positive_s + cold.setup_s
    assert served.failures() == cold.failures() == []


def test_recorded_memcheck_batches_needed_reruns():
    """Why cases that may fault are not batched under MPS (repro.mps_cases): memcheck cases in batches of 12."""
    run = load_json(RESULTS / "h200-memcheck-batched" / "new" / "results.json")
    reruns = [r for s, r in run.results if "rerun alone" in r.reason]
    assert len(reruns) == 11 and all("in a batch of 12 MPS clients" in r.reason for r in reruns)
    assert run.failures() == []


def test_matrix_gate_uses_the_one_gate_rule():
    """matrix --gate on recorded runs: every control met and kernel evidence -> passes; audit controls met by the
    audit alone pass one by one, but a run with no kernel evidence at all fails with the one line pytest --gate uses."""
    from repro.report import gate_failures

    assert gate_failures(load_json(RESULTS / "h200-executors" / "new" / "results.json")) == []
    audit_only = load_json(RESULTS / "h200-spec-graph-nopoison" / "results.json")
    assert {r.verdict for _, r in audit_only.results} == {STALE_AUDIT, CLEAN}
    why = gate_failures(audit_only)  # each mode (eager, graph) needs its own kernel evidence: two lines
    assert len(why) == 2 and all(w.startswith("GATE FAILED: mode ") for w in why)
    assert {w.split(":")[1].strip() for w in why} == {"mode eager", "mode graph"}
    eager_only = load_json(RESULTS / "h200-executors" / "new" / "results.json")
    for s, r in eager_only.results:
        if s.mode == "graph" and r.expected != "clean":
            r.verdict, r.expected = STALE_AUDIT, "audit"  # graph controls met one by one by the audit alone
    assert gate_failures(eager_only) == [
        "GATE FAILED: mode graph: none of its 12 positive control(s) produced kernel evidence: this environment "
        "cannot show that this mode sees the bug"
    ]
    run = load_json(RESULTS / "h200-executors" / "new" / "results.json")
    run.results[0][1].verdict = "skip"
    run.results[-1][1].verdict = CRASH  # a fresh case that faulted
    why = gate_failures(run)
    assert len(why) == 2 and "skip: the gate has no evidence" in why[0] and "negative control came back crash" in why[1]


@pytest.mark.parametrize("name", ["h200-executors", "h200-memcheck-executors"])
def test_bench_paths_renders_what_the_gpu_run_printed(name):
    """`bench --paths OLD NEW` on the recorded runs gives the very table `matrix --compare-executors` wrote there."""
    from repro.benchmark import paths_from_files

    md = paths_from_files(RESULTS / name / "old" / "results.json", RESULTS / name / "new" / "results.json")
    recorded = (RESULTS / name / "executors.md").read_text()
    assert md == recorded[recorded.index("## Case execution paths") :]


def test_bench_paths_refuses_different_matrices():
    from repro.benchmark import paths_from_files
    from repro.descriptors import ConfigError

    with pytest.raises(ConfigError, match="different matrices"):
        paths_from_files(
            RESULTS / "h200-executors" / "old" / "results.json", RESULTS / "h200-spec-graph" / "results.json"
        )
