"""Reports rendered from runs recorded on the H200, and the expectation rules."""

import json
import re
from pathlib import Path

import pytest

from repro.case.matrix import MatrixOptions, build_specs
from repro.case.spec import CaseSpec, SmConfig
from repro.contract.verdicts import CLEAN, CRASH, HANG, LAUNCH_FAIL, OOB, STALE_AUDIT, WRONG
from repro.errors import ConfigError
from repro.judge.expectations import expectation
from repro.judge.policy import EXPECTATIONS, satisfies
from repro.report import results as report
from repro.report.results import is_vllm_gate_record, load_json
from repro.run.matrix import MatrixRun
from tests.commands import no_traceback, run_repro
from tests.records import RESULTS

H200_RUN = RESULTS / "h200-default" / "results.json"


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


def test_harness_blind_counts_only_controls_without_evidence():
    """Wrong output where a fault was expected is kernel evidence: a disagreement, said apart, never HARNESS BLIND."""
    run = report.load_json(RESULTS / "h200-default-evidence" / "results.json")
    assert run.failures() == [] and report.control_lines(run) == []
    faults = [(s, r) for s, r in run.results if r.expected == "fault"]
    (s1, r1), (s2, r2), (s3, r3) = faults[:3]
    r1.verdict = r2.verdict = WRONG  # detected, of another kind (the window cases on the H200)
    r3.verdict = CLEAN  # not detected: blind
    assert run.blind_controls() == [(s3, r3)]
    assert run.disagreements() == [(s1, r1), (s2, r2)]
    blind, dis = report.control_lines(run)
    assert blind.startswith("HARNESS BLIND: 1 positive control(s) not detected") and s3.case_id in blind
    assert s1.case_id not in blind and s2.case_id not in blind
    assert dis.startswith("DISAGREEMENT (detected, not blind): 2 positive control(s)")
    assert f"{s1.case_id}: wrong-output, expected fault" in dis
    r3.verdict = CRASH
    assert [x.split(":")[0] for x in report.control_lines(run)] == ["DISAGREEMENT (detected, not blind)"]
    assert "3 unexpected" not in report.markdown(run) and "2 unexpected (2 of them detected" in report.markdown(run)


@pytest.mark.parametrize("expected", EXPECTATIONS)
def test_harness_blind_and_disagreement_are_the_policys_judgement(expected):
    """For every expectation and verdict the matrix's lines say what the gate decides (repro.judge.policy):
    HARNESS BLIND is a positive control the gate fails (`problem`), DISAGREEMENT one it lists as evidence of another
    kind (`disagrees`); a negative control is neither, whatever its case's strategy, and a skip did not run."""
    from repro.case.spec import CaseResult
    from repro.contract.verdicts import SKIP, VERDICTS
    from repro.judge.policy import disagrees, is_positive, problem

    for strategy in ("stale", "fresh"):
        for verdict in VERDICTS:
            s = _spec(strategy=strategy)
            run = MatrixRun([(s, CaseResult(s.case_id, verdict, "r", expected=expected))], 1.0, None)
            blind, dis = bool(run.blind_controls()), bool(run.disagreements())
            ran = verdict != SKIP
            assert blind == (ran and is_positive(expected) and problem(expected, verdict) is not None), verdict
            assert dis == disagrees(expected, verdict) == bool(report.gate_decision(run).disagreements), verdict
            assert not (blind and dis)
            lines = [x.split(":")[0] for x in report.control_lines(run)]
            assert lines == ["HARNESS BLIND"] * blind + ["DISAGREEMENT (detected, not blind)"] * dis


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
    assert expectation(_spec(scenario="pair", pair=("t4r1", "t32r8"))) == "detected"  # measured (h200-pytest-gpu)
    for other in (("t8r2", "t32r8"), ("t32r8", "t4r1")):  # matrix --built-for/--launched: a pair nobody measured
        assert expectation(_spec(scenario="pair", pair=other)) == "audit"
        assert expectation(_spec(scenario="pair", pair=other, strategy="fresh")) == "clean"
    assert not satisfies("fault", HANG) and satisfies("detected", HANG)  # a hang is not a memory fault
    assert satisfies("detected", LAUNCH_FAIL) and not satisfies("detected", STALE_AUDIT)
    assert satisfies("audit", STALE_AUDIT)


def test_features_the_model_does_not_model_expect_audit(tmp_path):
    """A sliding window: the model predicts a fault, the H200 gave wrong-output: no guess, `audit`."""
    from repro.case.descriptors import AttnConfig
    from repro.case.spec import CaseResult
    from repro.judge.expectations import unmodelled
    from repro.report.agreement import compare

    for w in (128, 256):
        for sm in (SmConfig("sm_margin", 16), SmConfig("full"), SmConfig("mps", 16)):
            for b in ("upstream", "vllm"):
                s = _spec(backend=b, sm=sm, cfg=AttnConfig(window_left=w, num_splits=0))
                assert expectation(s) == "audit", s.case_id
                assert unmodelled(s) and unmodelled(s)[0].startswith("sliding window")
    windowed = AttnConfig(window_left=128)
    assert expectation(_spec(sm=SmConfig("green", 16), poison=None, cfg=windowed)) == "audit"  # measured unwindowed
    assert expectation(_spec(scenario="spec-decode", cfg=windowed)) == "audit"
    assert expectation(_spec(strategy="fresh", cfg=windowed)) == "clean"  # negative controls stay clean
    assert unmodelled(_spec()) == [] and expectation(_spec()) == "fault"  # no window: the model decides
    # `agree` leaves such cases out: the model makes no claim there to agree or disagree with
    s = _spec(cfg=AttnConfig(window_left=128, num_splits=0))
    report.write_json(MatrixRun([(s, CaseResult(s.case_id, WRONG, "wrong", spec=json.loads(s.to_json())))], 1.0, None),
                      tmp_path / "r.json")  # fmt: skip
    assert compare([tmp_path / "r.json"]) == []


RECORDED = sorted(
    p
    for pattern in ("h200-*/results.json", "h200-*/old/results.json", "h200-*/new/results.json")
    for p in (RESULTS).glob(pattern)
    if not is_vllm_gate_record(p)  # matrix runs; real-vLLM gate records have their tests
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
    from repro.case.spec import CaseResult
    from repro.run.matrix import MatrixRun

    spec = _spec(sm=SmConfig("mps", 16))
    report.write_json(MatrixRun([(spec, CaseResult.skipped(spec, "no MPS"))], 1.0, None), tmp_path / "r.json")
    ((s, r),) = report.load_json(tmp_path / "r.json").results
    assert s == spec and r.verdict == "skip" and r.reason == "no MPS"


def _raw(path: Path) -> list[dict]:
    """The case rows of a results.json as written, read without the harness's loader."""
    return json.loads(Path(path).read_text())["cases"]


def _changed(path: Path, tmp_path: Path, change) -> MatrixRun:
    """A copy of a recorded results.json with change(row) applied to every case row (its result too), loaded."""
    doc = json.loads(Path(path).read_text())
    for row in doc["cases"]:
        change(row)
    out = tmp_path / f"{path.parent.name}-changed.json"
    out.write_text(json.dumps(doc))
    return load_json(out)


def _set_verdict(row: dict, verdict: str) -> None:
    row["verdict"] = row["result"]["verdict"] = verdict


POSITIVE = ("fault", "detected", "audit")


def test_recorded_execution_paths_agree_and_the_new_one_is_faster(tmp_path):
    """results/h200-executors and h200-memcheck-executors: both paths in one command on the H200. The verdict diff
    and the per-phase means the benchmark computes, against counts made here from the raw rows; one verdict changed
    in a copy shows in the diff. The new path's wall time is lower, its crashed first positive control split into
    start-up phases."""
    from repro.report.benchmark import PHASES, paths_markdown, summarize

    for name in ("h200-executors", "h200-memcheck-executors", "h200-memcheck-warm", "h200-executors-served"):
        paths = {p: RESULTS / name / p / "results.json" for p in ("old", "new")}
        raw = {p: {c["case"]: c["result"] for c in _raw(f)} for p, f in paths.items()}
        differ = sorted(k for k in raw["old"] if raw["old"][k]["verdict"] != raw["new"].get(k, {}).get("verdict"))
        old, new = (load_json(f) for f in paths.values())
        md = paths_markdown({"old": old, "new": new})
        assert f"Verdict diff: {len(differ)} case(s)" in md and differ == [], name
        phased = [r["phases"] for r in raw["new"].values() if r.get("phases") and all(k in r["phases"] for k in PHASES)]
        means = summarize(new)["phases_mean_s"]
        for k in PHASES:
            assert means[k] == pytest.approx(sum(ph[k] for ph in phased) / len(phased), abs=1e-3), (name, k)
        assert summarize(new)["cases"] == len(raw["new"]) and new.wall_s < old.wall_s
        first = raw["new"][new.first_positive_case]
        assert set(first["phases"]) == {"start_s", "import_s", "cuda_init_s", "rest_s"}
        gone = next(k for k in sorted(raw["new"]) if raw["old"][k]["verdict"] != CLEAN)
        changed = _changed(paths["new"], tmp_path, lambda c, k=gone: c["case"] == k and _set_verdict(c, CLEAN))
        md = paths_markdown({"old": old, "new": changed})  # one case turned clean on the new path: the diff names it
        assert f"Verdict diff: 1 case(s):\n- {gone}: {raw['old'][gone]['verdict']} -> clean\n" in md
    plain_new = load_json(RESULTS / "h200-executors" / "new" / "results.json")
    assert plain_new.wall_s < 30 and summarize(plain_new)["phases_mean_s"]["import_s"] == 0.0  # forked: no import


def test_recorded_memcheck_processes_started_ahead(tmp_path):
    """results/h200-memcheck-warm: memcheck cases in processes started ahead of them (WarmPool), stopped once their
    first error was written whole, the MPS server never refusing a client. failures() against the raw rows (none
    recorded not ok; with every positive control turned clean in a copy, exactly the positive controls counted here),
    the reruns the paths table counts against the raw reasons, the verdicts and kernels of the old path."""
    from repro.report.benchmark import paths_markdown

    path = RESULTS / "h200-memcheck-warm" / "new" / "results.json"
    raw = _raw(path)
    old, new = (load_json(RESULTS / "h200-memcheck-warm" / p / "results.json") for p in ("old", "new"))
    assert new.wall_s < 60 < old.wall_s
    assert len(new.failures()) == sum(not c["ok"] for c in raw) == 0
    positives = sorted(c["case"] for c in raw if c["expected"] in POSITIVE)
    blind = _changed(path, tmp_path, lambda c: c["expected"] in POSITIVE and _set_verdict(c, CLEAN))
    assert sorted(s.case_id for s, _ in blind.failures()) == positives and len(positives) == 24
    assert [(s.case_id, r.verdict, r.kernel) for s, r in old.results] == [
        (c["case"], c["result"]["verdict"], c["result"]["kernel"]) for c in raw
    ]
    reruns = sum("rerun alone" in c["result"]["reason"] for c in raw)
    assert f"MPS cases rerun alone on the new path: {reruns}" in paths_markdown({"old": old, "new": new})
    assert reruns == 0 and not any("refusal" in c["result"]["reason"] for c in raw)
    stale = [c for c in raw if c["strategy"] == "stale"]
    assert len(stale) == 24 and all("after memcheck's first complete finding" in c["reason"] for c in stale)
    waited = [r.phases["start_s"] for _, r in new.results if r.phases]
    assert max(waited) > 1 and min(waited) < 0.1  # the first ones waited for their imports, later ones found them done


def test_recorded_served_path_shows_the_first_verdict_within_3_s():
    """results/h200-executors-served: three paths in one command; results/h200-default-served and -cold: the first
    positive control counted from the command's start, with and without a repro server running. The paths' diffs
    against the raw rows; failures() against the raw ok flags; the first positive case is a positive control that
    showed kernel evidence in the raw rows."""
    from repro.report.benchmark import paths_markdown

    files = {p: RESULTS / "h200-executors-served" / p / "results.json" for p in ("old", "new", "served")}
    runs = {p: load_json(f) for p, f in files.items()}
    raw = {p: {c["case"]: c["result"]["verdict"] for c in _raw(f)} for p, f in files.items()}
    md = paths_markdown(runs)
    for p, diff in (("new", "Verdict diff:"), ("served", "Verdict diff, old -> served:")):
        n = sum(raw["old"][k] != raw[p].get(k) for k in raw["old"])
        assert f"{diff} {n} case(s)" in md and n == 0
    assert runs["served"].first_positive_s < 3 < runs["new"].first_positive_s < runs["old"].first_positive_s
    assert runs["served"].wall_s < runs["new"].wall_s < 30
    for p in ("served", "cold"):
        f = RESULTS / f"h200-default-{p}" / "results.json"
        run, rows = load_json(f), {c["case"]: c for c in _raw(f)}
        assert len(run.failures()) == sum(not c["ok"] for c in rows.values()) == 0
        first = rows[run.first_positive_case]
        assert first["expected"] in POSITIVE and first["verdict"] in (OOB, CRASH, LAUNCH_FAIL, HANG, WRONG)
    served, cold = (load_json(RESULTS / f"h200-default-{p}" / "results.json") for p in ("served", "cold"))
    assert served.first_positive_s + served.setup_s < 3 < cold.first_positive_s + cold.setup_s


def test_recorded_memcheck_batches_needed_reruns():
    """Why cases that may fault are not batched under MPS (repro.run.mps_cases): memcheck cases in batches of 12. The
    cases the paths table lists as rerun alone are those whose raw reason says so."""
    from repro.report.benchmark import paths_markdown

    path = RESULTS / "h200-memcheck-batched" / "new" / "results.json"
    raw = _raw(path)
    rerun = [c["case"] for c in raw if "rerun alone" in c["result"]["reason"]]
    run = load_json(path)
    md = paths_markdown({"old": run, "new": run})
    listed = md.split("MPS cases rerun alone on the new path: ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert listed[0] == str(len(rerun)) == "11" and listed[1:] == [f"- {c}" for c in rerun]
    assert all("in a batch of 12 MPS clients" in raw_c["result"]["reason"] for raw_c in raw if raw_c["case"] in rerun)
    assert len(run.failures()) == sum(not c["ok"] for c in raw) == 0


def test_matrix_gate_uses_the_one_gate_rule(tmp_path):
    """matrix --gate on recorded runs: every control met and kernel evidence -> passes; audit controls met by the
    audit alone pass one by one, but a mode with no kernel evidence at all fails with the one line pytest --gate uses.
    The positive controls per mode the decision counts, against counts made here from the raw rows."""
    from repro.report.results import gate_decision, gate_failures

    path = RESULTS / "h200-executors" / "new" / "results.json"
    raw = _raw(path)

    def mode(c: dict) -> str:
        return "memcheck" if c["sanitizer"] else c["mode"]

    evidence = (OOB, CRASH, LAUNCH_FAIL, HANG, WRONG)
    want = {}
    for c in raw:
        if c["expected"] in POSITIVE:
            pos, ev = want.get(mode(c), (0, 0))
            want[mode(c)] = (pos + 1, ev + (c["result"]["verdict"] in evidence))
    d = gate_decision(load_json(path))
    assert d.evidence == want and d.failures == [] and d.ran == len(raw)
    audit_path = RESULTS / "h200-spec-graph-nopoison" / "results.json"
    audit_only = load_json(audit_path)
    assert {r.verdict for _, r in audit_only.results} == {STALE_AUDIT, CLEAN}
    why = gate_failures(audit_only)  # each mode (eager, graph) needs its own kernel evidence: one line each
    modes = sorted({mode(c) for c in _raw(audit_path) if c["expected"] in POSITIVE})
    assert sorted(w.split(":")[1].strip() for w in why) == [f"mode {m}" for m in modes] == ["mode eager", "mode graph"]
    graph_positive = sum(1 for c in raw if mode(c) == "graph" and c["expected"] != "clean")

    def audit_alone(c: dict) -> None:  # graph controls met one by one by the audit alone
        if mode(c) == "graph" and c["expected"] != "clean":
            _set_verdict(c, STALE_AUDIT)
            c["expected"] = c["result"]["expected"] = "audit"

    assert gate_failures(_changed(path, tmp_path, audit_alone)) == [
        f"GATE FAILED: mode graph: none of its {graph_positive} positive control(s) produced kernel evidence: this "
        "environment cannot show that this mode sees the bug"
    ]
    first, last = raw[0]["case"], raw[-1]["case"]
    assert raw[-1]["expected"] == "clean" and raw[0]["expected"] in POSITIVE

    def skip_and_crash(c: dict) -> None:
        if c["case"] == first:
            _set_verdict(c, "skip")
        elif c["case"] == last:
            _set_verdict(c, CRASH)  # a fresh case that faulted

    why = gate_failures(_changed(path, tmp_path, skip_and_crash))
    assert why == [
        f"{first}: skip: the gate has no evidence from this control: {raw[0]['result']['reason'][:160]}",
        f"{last}: negative control came back crash: {raw[-1]['result']['reason'][:160]}",
    ]


@pytest.mark.parametrize("name", ["h200-executors", "h200-memcheck-executors"])
def test_bench_paths_renders_what_the_gpu_run_printed(name):
    """`bench --paths OLD NEW` on the recorded runs gives the very table `matrix --compare-executors` wrote there."""
    from repro.report.benchmark import paths_from_files

    md = paths_from_files(RESULTS / name / "old" / "results.json", RESULTS / name / "new" / "results.json")
    recorded = (RESULTS / name / "executors.md").read_text()
    assert md == recorded[recorded.index("## Case execution paths") :]


def test_bench_paths_refuses_different_matrices():
    from repro.errors import ConfigError
    from repro.report.benchmark import paths_from_files

    with pytest.raises(ConfigError, match="different matrices"):
        paths_from_files(
            RESULTS / "h200-executors" / "old" / "results.json", RESULTS / "h200-spec-graph" / "results.json"
        )


def test_heatmap_of_a_prediction_says_so(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from repro.case.spec import CaseResult, CaseSpec
    from repro.report import results as report
    from repro.run.matrix import MatrixRun

    titles = []
    monkeypatch.setattr(Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    results = [(CaseSpec("vllm", "stale"), CaseResult("c", "clean", ""))]
    assert report.heatmap(MatrixRun(results, 0.1, None, source=report.MODEL), tmp_path / "m.png")
    assert report.heatmap(MatrixRun(results, 0.1, None, source=report.GPU), tmp_path / "g.png")
    assert titles[0].startswith("predicted by the CPU model (no kernels ran)")
    assert "predicted" not in titles[1]


def test_predicted_table_names_its_columns_and_says_what_a_prediction_is(tmp_path):
    r = run_repro("matrix", "--model-sms", "16", "--json", str(tmp_path / "m.json"), cwd=tmp_path)
    no_traceback(r)
    assert r.returncode == 0, r.stderr
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("| case |"))
    assert "| met? |" in header and "| |" not in header
    cases = json.loads((tmp_path / "m.json").read_text())["cases"]
    stale = [c for c in cases if c["strategy"] == "stale"]
    fresh = [c for c in cases if c["strategy"] == "fresh"]
    assert len(stale) == len(fresh) == 4
    for c in stale:  # what the model knows: the entries that differ from a fresh build
        assert c["verdict"] == "oob" and c["evidence"] == "CPU model: out-of-bounds read predicted"
        assert c["stale_fields"] and "scheduler_metadata.num_splits_dynamic" in c["stale_fields"]
        assert f"| {c['case']} | **oob** | CPU model: out-of-bounds read predicted |" in r.stdout
        assert re.search(rf"\| {re.escape(c['case'])} \|.*\| ok \| [^|]*md\.num_splits_dynamic:\d+", r.stdout)
    for c in fresh:
        assert c["verdict"] == "clean" and c["stale_fields"] == {}
        assert "no pass" not in c["reason"] and "fresh strategy builds metadata for every pass" in c["reason"]
        assert c["evidence"] == "CPU model: clean run predicted"
    legend = r.stdout.split("What the columns mean:", 1)[1].split("Reasons:", 1)[0]
    assert "**met?**" in legend and "**stale fields**" in legend
    assert "so no pass runs on stale metadata" in legend
    assert "prediction of the CPU model" in legend and "compute-sanitizer memcheck finding" in legend
    assert "Why `main` and not the split-KV combine kernel" in legend
    assert "not attributed" not in legend  # the model names a kernel: no crash row to explain


def test_gpu_table_says_why_a_crash_names_no_kernel():
    from repro.report import results as report

    run = report.load_json(H200_RUN)  # a GPU run without --sanitizer: its crashes name no kernel
    md = report.markdown(run)
    assert "| not attributed |" in md
    legend = md.split("What the columns mean:", 1)[1].split("Reasons:", 1)[0]
    line = next(ln for ln in legend.splitlines() if "not attributed" in ln)
    assert "faulting line" in line and "--sanitizer" in line and "CUDA_LAUNCH_BLOCKING=1 rerun" in line
    assert "prediction of the CPU model" not in legend


def test_a_live_results_json_missing_a_key_is_an_error_naming_it(tmp_path):
    """A results.json of this schema is read as written: a case result without its flags is no record of it (never
    read as flagless), the key named."""
    from repro.case.spec import CaseResult
    from repro.run.matrix import MatrixRun

    spec = _spec()
    report.write_json(
        MatrixRun([(spec, CaseResult(spec.case_id, "clean", "ok", spec=json.loads(spec.to_json())))], 1.0, None),
        tmp_path / "r.json",
    )
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["schema"] == report.SCHEMA and report.load_json(tmp_path / "r.json").results[0][1].flags == []
    del doc["cases"][0]["result"]["flags"]
    (tmp_path / "r.json").write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match="has no 'flags' field"):
        report.load_json(tmp_path / "r.json")


def test_a_recorded_results_json_gets_its_flags_from_the_one_upgrader_and_a_refused_case_is_not_a_rerun(tmp_path):
    """A record of an older schema said in its reasons what flags say now: its reruns alone get RERUN_ALONE, a case
    the GPU refused gets REFUSED and not RERUN_ALONE (its reason ends 'rerun alone' as advice), a stall STALLED."""
    from repro.case.spec import REFUSED, RERUN_ALONE, STALLED
    from repro.report.records import upgrade_result

    path = RESULTS / "h200-default" / "results.json"
    assert json.loads(path.read_text()).get("schema", 1) < report.SCHEMA  # recorded before typed flags
    reasons = {
        "the GPU refused this process (busy or unavailable): another client faulted it; rerun alone": [REFUSED],
        "9 passes, max |out - reference| = 0.0156 (rerun alone: error in a batch of 12 MPS clients)": [RERUN_ALONE],
        "stalled: no output for 45 s after 'Capturing CUDA graphs' (killed as hung)": [STALLED],
        "9 passes, max |out - reference| = 0.0": [],
    }
    for reason, flags in reasons.items():
        assert upgrade_result({"reason": reason})["flags"] == flags, reason
    assert upgrade_result({"reason": "(rerun alone: x)", "flags": []})["flags"] == []  # a result with its flags: as is

    def refused(row):
        row["result"]["reason"] = next(iter(reasons))

    assert not any(RERUN_ALONE in r.flags for _, r in _changed(path, tmp_path, refused).results)
