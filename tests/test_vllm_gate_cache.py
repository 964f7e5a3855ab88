"""The vLLM gate's new path (repro.vllm_integration.gate.cache, gate_bench): the cache keys (two builds never share a
cache, a changed build invalidates it), what a case gets from and gives to its build's cache, kept references, the
phase split read from real H200 logs, and the old/new comparison end to end on stand-in builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repro.contract.channel import Channel
from repro.contract.verdicts import CLEAN
from repro.vllm_integration.gate import bench as gate_bench
from repro.vllm_integration.gate import report as gate_report
from repro.vllm_integration.gate.cache import COLD, VLLM_CACHE, WARM, WRITER, GateCache, package_fingerprint
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.paths import FORK_COLD, FORK_WARM, NEW_COLD, NEW_WARM, OLD_PATH, compare_paths
from repro.vllm_integration.gate.report import build_summary
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.releases.builds import CONTROL, UNDER_TEST, parse_builds
from tests.fake_vllm import write_fake_vllm
from tests.records import RESULTS

RECORDED = RESULTS / "h200-vllm-release-range" / "logs"


def _build(tmp_path: Path, name: str, behaviour: str = "good", version: str = "0.26.0"):
    prefix = write_fake_vllm(tmp_path / name, version, behaviour)
    return parse_builds(f"{name}={prefix}", UNDER_TEST, "REPRO_VLLM")[0]


def test_two_builds_never_share_a_cache_and_a_change_invalidates_it(tmp_path):
    good, crash = _build(tmp_path, "good"), _build(tmp_path, "crash", "stale-crash", "0.25.1")
    same = _build(tmp_path, "copy")  # the same files in another folder: the same build
    cache = GateCache(tmp_path / "c")
    assert cache.fingerprint(good) != cache.fingerprint(crash)
    assert cache.fingerprint(good) == cache.fingerprint(same)
    assert json.loads((cache.build_dir(good) / "build.json").read_text())["python_files"] > 5
    pkg = Path(good.prefix) / "vllm"
    before, _ = package_fingerprint(pkg)
    (pkg / "v1" / "worker" / "gpu" / "model_runner.py").write_text("# one line changed\n", "utf-8")
    assert package_fingerprint(pkg)[0] != before  # a Python file
    so = pkg / "_C.abi3.so"
    so.write_bytes(b"\x7fELF" + bytes(3 << 20))
    with_so, _ = package_fingerprint(pkg)
    data = bytearray(so.read_bytes())
    data[-10] = 1  # the end of a compiled extension (its symbol tables, its build id)
    so.write_bytes(bytes(data))
    assert package_fingerprint(pkg)[0] != with_so
    assert GateCache(tmp_path / "c").fingerprint(good) != cache.fingerprint(same)  # a new run fingerprints again


def test_one_writer_compiles_into_the_build_folder_and_later_cases_use_it_in_place(tmp_path):
    """vLLM's AOT record names its artifacts by absolute path (a copied cache failed to load on the H200: 'No such
    file or directory: .../artifact_compile_range_1_16384_subgraph_0'), so the build's folder is written in place by
    one case and used in place by the cases after it."""
    build = _build(tmp_path, "good")
    cache = GateCache(tmp_path / "c")
    shared = cache.build_dir(build) / VLLM_CACHE
    root, state = cache.case_cache(build, tmp_path / "p1")
    assert (root, state) == (shared, WRITER) and root.is_dir()
    root2, state2 = cache.case_cache(build, tmp_path / "p2")  # a case started while the writer compiles
    assert (root2, state2) == (tmp_path / "p2", COLD) and not any(root2.iterdir())
    ref_root, ref_state = cache.case_cache(build, tmp_path / "p3", may_write=False)  # a reference compiles nothing
    assert ref_state == COLD
    (shared / "torch_compile_cache").mkdir()
    cache.release(build, compiled=True)
    assert cache.case_cache(build, tmp_path / "p4") == (shared, WARM)
    assert GateCache(tmp_path / "c").case_cache(build, tmp_path / "p5") == (shared, WARM)  # the next gate run


def test_a_writer_that_never_compiled_leaves_nothing_and_a_dead_claim_is_taken_over(tmp_path):
    build = _build(tmp_path, "good")
    cache = GateCache(tmp_path / "c")
    shared = cache.build_dir(build) / VLLM_CACHE
    assert cache.case_cache(build, tmp_path / "p1")[1] == WRITER
    (shared / "half-written").write_text("x")
    cache.release(build, compiled=False)  # e.g. a hang killed before torch.compile finished
    assert not shared.exists()
    assert cache.case_cache(build, tmp_path / "p2")[1] == WRITER and not (shared / "half-written").exists()
    (cache.build_dir(build) / "vllm-cache.claim").write_text("999999999")  # a gate run that was killed
    assert GateCache(tmp_path / "c").case_cache(build, tmp_path / "p3")[1] == WRITER
    other = _build(tmp_path, "crash", "stale-crash", "0.25.1")
    assert cache.case_cache(other, tmp_path / "p4")[0] == cache.build_dir(other) / VLLM_CACHE  # its own folder


def test_a_run_without_torch_compile_never_completes_the_inductor_folder(tmp_path):
    """--compile none leaves no inductor artifacts: its writer completes a folder of its own, and an inductor case
    after it still writes (compiles) instead of reading an empty folder as warm."""
    build = _build(tmp_path, "good")
    cache = GateCache(tmp_path / "c")
    none_root, state = cache.case_cache(build, tmp_path / "p1", compile="none")
    assert state == WRITER and none_root == cache.build_dir(build) / f"{VLLM_CACHE}-none"
    assert cache.case_cache(build, tmp_path / "p2")[1] == WRITER  # the inductor writer, beside it: not its claim
    cache.release(build, compiled=True, compile="none")
    assert cache.case_cache(build, tmp_path / "p3", compile="none") == (none_root, WARM)
    assert cache.case_cache(build, tmp_path / "p4")[1] == COLD  # the inductor writer still holds its claim
    cache.release(build, compiled=True)
    assert cache.case_cache(build, tmp_path / "p5") == (cache.build_dir(build) / VLLM_CACHE, WARM)


def test_phases_from_a_real_h200_case():
    """0.26.0's plain case of the release-range run: vLLM's config and model-registry inspection 38 s (two
    subprocesses that import vLLM again, what the shared model-info cache saves), torch.compile 9.98 + 2.96 s, graph
    capture 3 s; the rest from the case's own RESULT record."""
    from repro.contract.channel import Channel
    from repro.contract.tags import RESULT_TAG

    log = (RECORDED / "stale_metadata-vllm-0.26.0-under-test-plain.out.log").read_text()
    result = Channel.read(RECORDED / "stale_metadata-vllm-0.26.0-under-test-plain.channel.jsonl").last(RESULT_TAG)
    lp = gate_bench.log_phases(log)
    assert (lp["config_s"], lp["compile_s"], lp["capture_s"], lp["compile_loaded"]) == (38.0, 12.94, 3.0, 0)
    p = gate_bench.phases(log, result, None, 110.0)
    assert p["import"] == 23.0 and p["engine"] == 80.5 and p["decode"] == 0.1
    assert p["engine_rest"] == pytest.approx(80.5 - 38.0 - 12.94 - 3.0, abs=0.1)
    assert "start" not in p and "teardown" not in p  # that record has no main_at/done_at: absent, not guessed
    crash = (RECORDED / "stale_metadata-vllm-0.25.1-control-plain.out.log").read_text()
    cp = gate_bench.phases(crash, None, None, 120.0)
    assert "import" not in cp and cp["compile"] > 0 and "capture" not in cp  # crashed inside the capture


def test_phases_add_process_start_and_teardown():
    result = {"timing_s": {"import": 10.0, "engine": 30.0, "generate": 1.0, "main_at": 1000.5, "done_at": 1042.0}}
    p = gate_bench.phases("", result, 1000.0, 45.0)
    assert (p["start"], p["teardown"], p["engine_rest"]) == (0.5, 3.0, 30.0)


def test_phases_split_the_imports_from_cudas_start():
    """A case's RESULT splits its start-up (torch and vLLM's import, CUDA's start with the GEMM check); a case that
    crashed after it has the split in its DEVICE record; a record from before the split keeps it all in `import`."""
    split = {"torch_import": 0.01, "cuda_init": 1.52, "vllm_import": 0.02}
    result = {"timing_s": {"import": 1.6, **split, "engine": 9.0, "generate": 0.5}}
    p = gate_bench.phases("", result, None, 12.0)
    assert (p["import"], p["cuda"], p["engine"]) == (0.0, 1.5, 9.0)
    crashed = gate_bench.phases("", None, None, 5.0, {"gpu": "H200", "startup_s": {**split, "torch_import": 18.3}})
    assert (crashed["import"], crashed["cuda"]) == (18.3, 1.5) and "engine" not in crashed
    old = gate_bench.phases("", {"timing_s": {"import": 23.0}}, None, 30.0, {"gpu": "H200"})
    assert old["import"] == 23.0 and "cuda" not in old


def test_verdict_differences_are_listed():
    diff = gate_bench.verdict_diff({"old": {"a": "crash", "b": "clean"}, "new": {"a": "crash", "b": "stale-audit"}})
    assert diff == ["b: old clean, new stale-audit"]
    assert gate_bench.verdict_diff({"old": {"a": "crash"}, "new": {}}) == ["a: old crash, new not run"]


def test_paths_differ_by_answer_and_other_evidence_is_listed_apart():
    """With each case's expectation: a control caught by a crash on one path and by wrong output on the other gives
    one answer (evidence_diff lists it); a build under test AFFECTED on one path and CANNOT VOUCH on the other, or
    clean on one and AFFECTED on the other, differs."""
    paths = {
        "old": {"ctl": ("crash", True), "bad": ("crash", False), "ok": ("clean", True), "same": ("clean", True)},
        "new": {
            "ctl": ("wrong-output", True),
            "bad": ("error", False),
            "ok": ("crash", False),
            "same": ("clean", True),
        },
    }
    diff = gate_bench.verdict_diff(paths)
    assert [d.split(":")[0] for d in diff] == ["bad", "ok"]
    assert diff[0] == "bad: old crash (NOT as expected), new error (NOT as expected)"
    assert gate_bench.evidence_diff(paths) == ["ctl: old crash (as expected), new wrong-output (as expected)"]


def test_kept_references_and_warm_caches_give_the_same_verdicts(tmp_path):
    builds = [_build(tmp_path, "good")]
    builds += parse_builds(f"crash={write_fake_vllm(tmp_path / 'crash', '0.25.1', 'stale-crash')}", CONTROL, "x")
    cache = GateCache(tmp_path / "c")
    modes = parse_modes("audit,plain")
    # forked case processes: the cache is the question, not the launcher (the spawned paths' caches and kept
    # references: test_compare_paths_runs_old_cold_warm_and_forked_with_no_verdict_difference)
    kw = dict(jobs=4, timeout_s=120, launcher="fork")
    first = run_gate(builds, modes, tmp_path / "l1", cache=cache, **kw)
    second = run_gate(builds, modes, tmp_path / "l2", cache=GateCache(tmp_path / "c"), **kw)
    assert [(c.case_id, r.verdict) for c, r in first.cases] == [(c.case_id, r.verdict) for c, r in second.cases]
    assert first.outcome() == second.outcome() == "PASS"
    assert all(
        r.verdict == CLEAN and [h["step"] for h in r.history] == ["reference validation"] for _, r in first.references
    )
    for c, r in second.references:  # run once, then kept for the build's fingerprint
        assert r.verdict == CLEAN and r.history[-1]["step"] == "reference cache"
        assert r.phases["vllm_cache"] == "reference kept"
        # the second run's logs hold the kept reference's records whole, as its process wrote them in the first run
        kept = Channel.of_case(tmp_path / "l2" / f"{c.case_id}.out.log")
        ran = Channel.of_case(tmp_path / "l1" / f"{c.case_id}.out.log")
        assert [x.tag for x in kept.records] == [x.tag for x in ran.records] and len(kept.records) > 1
    seen = [r.phases["vllm_cache"] for _, r in first.cases]  # a case started after its build's writer finished is warm
    assert set(seen) <= {WRITER, COLD, WARM} and WRITER in seen  # a writer wrote the caches the second run finds
    assert {r.phases["vllm_cache"] for _, r in second.cases} == {WARM}  # the stand-in's captures ran: compiled
    # the self control shares its build's caches and reference: it runs beside the build's cases, never cold on its own
    rows = [("good", "cold"), ("good (self control)", "cold"), ("good (self control, stale-descriptor)", "cold")]
    assert [(b["build"], b["caches"]) for b in build_summary(first)] == [*rows, ("crash", "cold")]
    assert [b["caches"] for b in build_summary(second)] == ["warm"] * 4
    assert len(second.references) == 2  # one per build: the self control is judged against its build's
    assert "| 0.26.0 | **no** |" in gate_report.markdown(second) and "(warm) | ok |" in gate_report.markdown(second)
    ref = next(r for c, r in second.cases if c.case_id.endswith("good-under-test-plain"))
    assert "tokens: 64 of 64 compared equal" in ref.evidence  # judged against the kept reference's tokens
    (Path(builds[0].prefix) / "vllm" / "_version.py").write_text('__version__ = "0.26.0+local"\n')
    third = run_gate(  # its self control aside: the reference is the question
        builds[:1], parse_modes("plain"), tmp_path / "l3", timeout_s=120, cache=GateCache(tmp_path / "c"),
        self_control="none", launcher="fork",
    )  # fmt: skip
    # a changed build: its reference runs again (validated, not kept)
    assert [h["step"] for h in third.references[0][1].history] == ["reference validation"]


@pytest.mark.slow  # five gate runs (conftest: started first)
def test_compare_paths_runs_old_cold_warm_and_forked_with_no_verdict_difference(tmp_path):
    builds = [_build(tmp_path, "good")]
    builds += parse_builds(f"crash={write_fake_vllm(tmp_path / 'crash', '0.25.1', 'stale-crash')}", CONTROL, "x")
    runs = compare_paths(
        builds, parse_modes("plain"), tmp_path / "logs", tmp_path / "cache", jobs=4, timeout_s=120, self_control="none"
    )
    assert list(runs) == [OLD_PATH, NEW_COLD, NEW_WARM, FORK_COLD, FORK_WARM]
    md = gate_bench.compare_markdown(runs)
    assert "### Verdict differences between the paths: 0" in md
    assert "| new (warm) | PASS |" in md and "| fork (warm) | PASS |" in md and "reference kept" in md
    assert md.count("-control-plain-launch-blocking |") == 5  # the attribution rerun on every path
    for name, run in runs.items():  # each path started its case processes as it says
        launched = {(r.phases or {}).get("launcher") for _, r in run.cases + run.attributions}
        assert launched == {"fork" if name.startswith("fork") else "spawn"}, (name, launched)
    with pytest.raises(Exception, match="empty cache folder"):
        compare_paths(builds, parse_modes("plain"), tmp_path / "logs2", tmp_path / "cache")


def test_compare_paths_can_leave_out_the_old_path_but_warm_needs_cold(tmp_path):
    builds = [_build(tmp_path, "good")]
    with pytest.raises(Exception, match="a warm run needs its cold one"):
        compare_paths(builds, parse_modes("plain"), tmp_path / "l", tmp_path / "c", paths=(NEW_WARM,))
    runs = compare_paths(  # no self control: which paths ran is the question, not what a control caught
        builds, parse_modes("plain"), tmp_path / "l", tmp_path / "c", timeout_s=120, paths=(NEW_COLD, NEW_WARM),
        self_control="none",
    )  # fmt: skip
    assert list(runs) == [NEW_COLD, NEW_WARM]


def test_prune_removes_the_build_folders_unused_longest_never_this_runs_or_a_held_one(tmp_path):
    import os
    import time

    from repro.vllm_integration.gate.cache import CLAIM, USED

    cache = GateCache(tmp_path / "c")
    base = tmp_path / "c" / "vllm-gate"
    now = time.time()
    for i, age_days in enumerate((1, 2, 3, 40, 4)):
        d = base / f"{i:020x}"
        d.mkdir(parents=True)
        (d / USED).write_text("x")
        os.utime(d / USED, (now - age_days * 86400, now - age_days * 86400))
    os.utime(base / f"{4:020x}" / USED, (now - 600, now - 600))  # used ten minutes ago: another run may hold it
    (base / f"{2:020x}" / CLAIM).write_text(str(os.getpid()))  # a writer compiling into it right now
    (base / "not-a-build").mkdir()
    mine = _build(tmp_path, "good")
    removed = cache.prune(keep=3, max_age_days=30, protect=[mine])
    # kept: this run's build, the one used ten minutes ago, the held one, then the most recent (1 day); 3 (40 days,
    # too old) and 1 (past the count) go
    assert sorted(p.name for p in removed) == [f"{1:020x}", f"{3:020x}"]
    assert (cache.build_dir(mine) / USED).exists() and (base / "not-a-build").is_dir()
    assert cache.prune(keep=12, max_age_days=30, protect=[mine]) == []
