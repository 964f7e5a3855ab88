"""The H200 records of the 2026-12-02 second session, judged again on a CPU (results/README.md, "Session of 2026-12-02
(2)"): kept forkservers meet issue 29's per-build goals with the verdicts of the old path; the eagle-layout self
control (0.20.2, 0.21.0) faults once the injection hands over the object too; memcheck's own allocator with poisoned
or guarded entries still names no access of 0.25.1's own fault; the processes that ran out of GPU memory (five gates
on one GPU at once) say so; a five-release sweep whose overlays lacked a dist-info could not start those builds."""

from __future__ import annotations

import json

import pytest

from repro.judge.classify import OUT_OF_MEMORY
from tests.recorded_gate import replay
from tests.records import RESULTS

V = "stale_metadata-vllm-"


def _replayed(monkeypatch, tmp_path, record: str):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / record)
    assert {k: r.verdict for k, r in got.items()} == {k: rows[k]["verdict"] for k in got}
    assert all("-attempt" in k for k in set(rows) - set(got))  # a self control's further attempts: kept in its row
    return doc, rows, run, got


def test_kept_forkservers_meet_the_per_build_goals_with_the_old_paths_verdicts():
    doc = json.loads((RESULTS / "h200-paths-kept" / "paths.json").read_text())
    paths = doc["paths"]
    assert list(paths) == ["old", "kept (cold)", "kept (warm)"] and "--compile none" in doc["environment"]["command"]
    verdicts = {p: {c: e["verdict"] for c, e in v["cases"].items()} for p, v in paths.items()}
    assert verdicts["old"] == verdicts["kept (cold)"] == verdicts["kept (warm)"]  # no verdict difference
    assert {v["outcome"] for v in paths.values()} == {"PASS"}
    assert paths["kept (cold)"]["build_wall_s"]["0.26.0"] < 60 and paths["kept (warm)"]["build_wall_s"]["0.26.0"] < 30
    cold, warm = (paths[p]["launches"]["0.26.0"] for p in ("kept (cold)", "kept (warm)"))
    assert (cold["spawned"], warm["spawned"]) == (0, 0) and cold["forked"] and warm["forked"]
    # the warm path took the forkserver the cold path started: the same process, no import of its own
    assert cold["forkserver"]["pid"] == warm["forkserver"]["pid"]
    assert (cold["forkserver"]["kept"]["reused"], warm["forkserver"]["kept"]["reused"]) == (False, True)
    assert warm["forkserver"]["ready_after_s"] < 1 < cold["forkserver"]["ready_after_s"]
    # a self control in each path: the build's verdict with its positive control
    assert verdicts["kept (warm)"][f"{V}0.26.0-self-control-compile-none-plain"] == "crash"


def test_the_eagle_self_control_faults_with_the_object_handed_over(monkeypatch, tmp_path):
    """0.20-0.22 build a draft capture's metadata once per descriptor for both passes; before, the injection could not
    place such a build and wrote the buffers alone: 0.20.2's self control decoded cleanly in plain (HARNESS BLIND).
    Handed the first descriptor's metadata too, it faults in audit and plain, in the combine kernel."""
    before = _replayed(monkeypatch, tmp_path / "before", "h200-release-table-2")[3]
    assert before[f"{V}0.20.2-self-control-plain"].verdict == "clean"
    old = RESULTS / "h200-release-table-2" / "logs" / f"{V}0.20.2-self-control-audit.audit.json"
    assert json.loads(old.read_text())["counters"]["inject_reuse_unplaced"] == 147
    doc, rows, run, got = _replayed(monkeypatch, tmp_path / "after", "h200-eagle-0.20.2-0.21.0")
    plain = got[f"{V}0.20.2-self-control-plain"]
    assert plain.verdict == "crash" and plain.kernel == "combine"
    assert got[f"{V}0.20.2-self-control-audit"].verdict == "crash"
    for release in ("0.20.2", "0.21.0"):
        audit = json.loads(
            (RESULTS / "h200-eagle-0.20.2-0.21.0" / "logs" / f"{V}{release}-self-control-audit.audit.json").read_text()
        )
        c = audit["counters"]
        assert c["spec_layout"] == "eagle" and c["inject_reused"]["both"] > 0 and "inject_reuse_unplaced" not in c
        assert c["captures_injected"]["draft prefill"] == 49
    # 0.21.0's self control: its draft silently wrong (a third of the draft tokens accepted, all of them without graphs)
    assert got[f"{V}0.21.0-self-control-plain"].verdict == "wrong-output"
    assert "32 of 96 draft tokens accepted" in got[f"{V}0.21.0-self-control-plain"].reason
    # 0.21.0 itself hung in the draft's prefill captures (its stall watch; five gates ran on the GPU at once): bad
    assert got[f"{V}0.21.0-under-test-plain"].verdict == "hang"
    assert run.outcome() == doc["outcome"] == "AFFECTED"


@pytest.mark.parametrize(
    "record, case",
    [
        ("h200-eagle-0.20.2-0.21.0", "0.20.2-under-test-plain"),  # torch's allocator
        ("h200-readme-gate-6", "0.26.0-under-test-plain"),
        ("h200-memcheck-own-guard", "0.26.0-under-test-compile-none-memcheck-own"),  # memcheck's log of cudaMalloc
    ],
)
def test_a_case_that_ran_out_of_gpu_memory_says_so(monkeypatch, tmp_path, record, case):
    got = _replayed(monkeypatch, tmp_path, record)[3]
    r = got[V + case]
    assert r.verdict == "error" and r.reason.startswith(OUT_OF_MEMORY) and "out of memory" in r.reason


def test_memcheck_with_poisoned_or_guarded_entries_names_no_access_of_0251s_own_fault(monkeypatch, tmp_path):
    """Issue 31's first goal, two more routes: int-max in the entries FA3 never writes makes 0.25.1 hang under memcheck
    (no finding in 240 s), splits-33 leaves it clean; guards as large as each tensor: a hang, no finding. The self
    control is an out-of-bounds read in FA3's main kernel under every one of them."""
    got = _replayed(monkeypatch, tmp_path / "p", "h200-memcheck-own-poison")[3]
    mode = "compile-none-memcheck-own-poison-"
    assert (
        got[f"{V}0.25.1-control-{mode}int-max"].verdict == "hang"
        and not got[f"{V}0.25.1-control-{mode}int-max"].findings
    )
    assert got[f"{V}0.25.1-control-{mode}splits-33"].verdict == "clean"
    guard = _replayed(monkeypatch, tmp_path / "g", "h200-memcheck-own-guard")[3]
    assert guard[f"{V}0.25.1-control-compile-none-memcheck-own"].verdict == "hang"
    for g, m in ((got, f"{mode}int-max"), (got, f"{mode}splits-33"), (guard, "compile-none-memcheck-own")):
        caught = g[f"{V}0.26.0-self-control-{m}"]
        assert caught.verdict == "oob" and caught.kernel == "main" and "allocation" in caught.reason


def test_a_sweep_whose_overlays_lack_their_dist_info_cannot_vouch_for_them(monkeypatch, tmp_path):
    """0.24.0's and 0.25.0's vllm/ without a dist-info (fixed since: Overlay.make writes one): vLLM found no platform in
    every case. The three other builds answered: 0.23.0 stale in audit, 0.25.1 crashing, 0.26.0 clean."""
    doc, rows, run, got = _replayed(monkeypatch, tmp_path, "h200-release-sweep-fast")
    log = (
        RESULTS / "h200-release-sweep-fast" / "logs" / f"{V}0.24.0-under-test-compile-none-plain.out.log"
    ).read_text()
    assert "Device string must not be empty" in log
    assert {
        got[f"{V}{b}-under-test-compile-none-{m}"].verdict for b in ("0.24.0", "0.25.0") for m in ("audit", "plain")
    } == {"error"}
    assert got[f"{V}0.23.0-under-test-compile-none-audit"].verdict == "stale-audit"
    assert got[f"{V}0.25.1-control-compile-none-plain"].kernel == "combine"
    assert got[f"{V}0.26.0-under-test-compile-none-plain"].verdict == "clean"
