"""The README's bare `gate` on its default path (forked case processes, inductor, each build's vLLM and Triton caches
in the gate's cache folder), judged again on a CPU from the H200 records it wrote: vLLM 0.34.0 with both forms of its
self control, cold (results/h200-readme-gate-8-cold) and warm (-warm), and the path comparison that found the warm
spawned path recompiling vLLM's JIT warmup kernels outside the cache (results/h200-paths-inductor-0.34.0)."""

from __future__ import annotations

import json
import re

import pytest

from repro.exit_codes import gate as gate_exit
from tests.recorded_gate import FAULTS, replay, same_verdicts
from tests.records import RESULTS

V = "stale_metadata-vllm-0.34.0-"
FINAL = RESULTS / "h200-readme-gate-9-cold"  # the same command on the code of the records after it
COLD, WARM, PATHS = (
    RESULTS / n for n in ("h200-readme-gate-8-cold", "h200-readme-gate-8-warm", "h200-paths-inductor-0.34.0")
)
JIT = re.compile(r"JIT kernel warmup finished in ([0-9.]+)s")


def _jit_seconds(logs) -> list[float]:
    """vLLM's own figure for its JIT warmup, per case process that got that far."""
    return [float(m[1]) for p in sorted(logs.glob("*.out.log")) if (m := JIT.search(p.read_text(errors="replace")))]


def test_the_bare_gate_passes_cold_and_warm_with_the_same_answers(monkeypatch, tmp_path):
    for record in (COLD, WARM, FINAL):
        doc, rows, run, got = replay(monkeypatch, tmp_path / record.name, record)
        same_verdicts(got, rows)
        assert all(got[f"{V}under-test-{m}"].verdict == "clean" for m in ("audit", "plain"))
        for form in ("self-control", "self-control-stale-descriptor"):
            assert all(got[f"{V}{form}-{m}"].verdict in FAULTS for m in ("audit", "plain")), form
        assert run.outcome() == doc["outcome"] == "PASS" and gate_exit(run.outcome()) == 0


def test_every_case_was_forked_and_the_warm_run_compiled_no_jit_kernels_again():
    for record in (COLD, WARM, FINAL):
        doc = json.loads((record / "results.json").read_text())
        (launch,) = doc["launches"].values()
        assert launch["launcher"] == "fork" and launch["spawned"] == 0 and launch["forked"] >= 6, launch
    cold, warm = _jit_seconds(COLD / "logs"), _jit_seconds(WARM / "logs")
    assert len(cold) >= 4 and len(warm) >= 4  # the cases that got past the engine's start, in both runs
    assert min(cold) > 20 and max(warm) < 5, (cold, warm)  # the build's Triton cache, found warm
    assert (
        json.loads((WARM / "results.json").read_text())["wall_s"]
        < 0.6 * json.loads((COLD / "results.json").read_text())["wall_s"]
    )


def test_before_the_fix_a_warm_spawned_case_compiled_its_jit_kernels_again():
    """The comparison on 7fb1149: the warm spawned path loaded the compiled model from the cache, but vLLM then points
    Triton at ~/.triton, cold there: its first cases spent 37 s in vLLM's JIT warmup (those started after them found
    what the first ones left there: 1.5 s), as the kept warm path did not only because it ran after it. The same
    verdicts on every path."""
    doc = json.loads((PATHS / "paths.json").read_text())
    assert {p: r["outcome"] for p, r in doc["paths"].items()} == dict.fromkeys(doc["paths"], "PASS")
    new_warm = _jit_seconds(PATHS / "logs" / "new-warm")
    assert len(new_warm) >= 4 and max(new_warm) > 20, new_warm


def test_the_phases_name_the_model_load_and_the_jit_warmup_apart_from_the_rest_of_the_engine():
    """gate_bench.phases on recorded cases of 0.34.0 (the comparison's kept paths): the JIT warmup (cold: about 59 s,
    warm: about 1 s) and the models' load are phases of their own, taken out of engine_rest, which the record (written
    before they were) held them in."""
    from repro.contract.channel import Channel, path_for
    from repro.contract.tags import RESULT_TAG
    from repro.vllm_integration.gate import bench as gate_bench

    paths = json.loads((PATHS / "paths.json").read_text())["paths"]
    for path, folder, jit in (("kept (cold)", "kept-cold", (40, 90)), ("kept (warm)", "kept-warm", (0, 5))):
        for case in (f"{V}under-test-plain", f"{V}under-test-audit"):
            log = PATHS / "logs" / folder / f"{case}.out.log"
            recorded = paths[path]["cases"][case]["phases"]
            result = Channel.read(path_for(log)).last(RESULT_TAG)
            now = gate_bench.phases(log.read_text(errors="replace"), result, None, recorded["wall"])
            assert jit[0] < now["jit"] < jit[1] and now["load"] > 1, (path, now)
            assert now["engine_rest"] == pytest.approx(recorded["engine_rest"] - now["jit"] - now["load"], abs=0.2)


FINAL_COLD, FINAL_WARM = RESULTS / "h200-readme-gate-14-cold", RESULTS / "h200-readme-gate-14-warm"
# the one-forkserver code (14085c4), cold and warm; and cold on the code after the review's fixes to it (877ddb6)
ONE_COLD, ONE_WARM, ONE_FINAL = (
    RESULTS / n for n in ("h200-readme-gate-15-cold", "h200-readme-gate-15-warm", "h200-readme-gate-16-cold")
)
LAST_COLD, LAST_WARM, KEPT_1, KEPT_2, PILOT = (
    RESULTS / n
    for n in (
        "h200-readme-gate-12-cold",
        "h200-readme-gate-12-warm",
        "h200-readme-gate-10-kept-1",
        "h200-readme-gate-10-kept-2",
        "h200-readme-gate-11-cold",
    )
)


LOAD = re.compile(r"Model loading took [0-9.]+ GiB memory and ([0-9.]+) seconds")


def _median_load_s(record) -> float:
    """vLLM's own figure for its model loading (the dummy loader, then the gate's weights), the median case's."""
    got = sorted(float(m[1]) for p in (record / "logs").glob("*.out.log") if (m := LOAD.search(p.read_text())))
    assert len(got) >= 4, record.name
    return got[len(got) // 2]


def test_the_last_bare_gate_passes_cold_and_warm_each_mode_caught_by_a_self_control_form(monkeypatch, tmp_path):
    """The README's bare gate on the code where the weights are built on the GPU and a hang before the captures is
    no evidence: PASS cold and warm; in each mode at least one self-control form
    showed kernel evidence (policy rule 6: a form that decoded right is listed, h200-readme-gate-12-cold's plain
    stale-capture form), the build itself clean."""
    for record in (LAST_COLD, LAST_WARM, PILOT, FINAL_COLD, FINAL_WARM, ONE_COLD, ONE_WARM, ONE_FINAL):
        doc, rows, run, got = replay(monkeypatch, tmp_path / record.name, record)
        same_verdicts(got, rows)
        assert all(got[f"{V}under-test-{m}"].verdict == "clean" for m in ("audit", "plain"))
        for m in ("audit", "plain"):
            forms = [got[f"{V}{form}-{m}"].verdict for form in ("self-control", "self-control-stale-descriptor")]
            assert any(v in FAULTS for v in forms), (record.name, m, forms)
        assert run.outcome() == doc["outcome"] == "PASS" and gate_exit(run.outcome()) == 0


def test_the_model_loads_in_about_a_second_once_its_weights_are_built_on_the_gpu():
    """The gate's weights were drawn on one CPU thread per case (vLLM sets torch's threads to 1): 9 s of model
    loading a case warm (h200-readme-gate-8-warm); built on the model's device, about 1 s (h200-readme-gate-12-*)."""
    assert _median_load_s(WARM) > 7
    assert _median_load_s(LAST_WARM) < 3 and _median_load_s(LAST_COLD) < 3


def test_a_kept_forkserver_takes_the_import_off_a_warm_run():
    """--keep-forkserver 120, run twice: the second run took the first one's forkserver (ready at once) and its wall
    is the cases' alone (30 s against 55 s)."""
    first, second = (json.loads((r / "results.json").read_text()) for r in (KEPT_1, KEPT_2))
    (l1,), (l2,) = first["launches"].values(), second["launches"].values()
    assert l1["forkserver"]["ready_after_s"] > 15 and l2["forkserver"]["ready_after_s"] < 1
    assert first["outcome"] == second["outcome"] == "PASS" and second["wall_s"] < 0.7 * first["wall_s"]


def test_sm_margin_and_mps_cases_fork_from_the_forkserver_with_the_same_answers(monkeypatch, tmp_path):
    """`gate --modes sm_margin:16,mps:16` under the fork default (h200-sm16-fork-0.34.0): every case forked, each
    SM configuration with its own validated reference, the build clean and each self-control form caught in both."""
    record = RESULTS / "h200-sm16-fork-0.34.0"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    same_verdicts(got, rows)
    (launch,) = doc["launches"].values()
    assert launch["launcher"] == "fork" and launch["spawned"] == 0 and launch["forked"] == 8
    assert {c.case_id for c, r in run.references if r.verdict == "clean"} == {
        f"{V}under-test-reference-smmargin16",
        f"{V}under-test-reference-mps16",
    }
    for m in ("smmargin16", "mps16"):
        assert got[f"{V}under-test-{m}"].verdict == "clean"
        assert all(got[f"{V}{f}-{m}"].verdict in FAULTS for f in ("self-control", "self-control-stale-descriptor"))
    assert run.outcome() == doc["outcome"] == "PASS"


def test_the_command_ends_within_seconds_of_its_run_its_forkserver_started_before_the_gpu_probes():
    """On the code of h200-readme-gate-14-*: the command's start-up before the run (setup_s) and its
    time after the run to its reports are seconds, not the 8-10 s the reports took when each of their rows parsed the
    vLLM tree again (h200-readme-gate-13-warm: run 52.6 s, the shell's 64.3 s); the records carry both figures."""
    for record in (FINAL_COLD, FINAL_WARM, ONE_COLD, ONE_WARM, ONE_FINAL):
        doc = json.loads((record / "results.json").read_text())
        assert doc["outcome"] == "PASS" and doc["setup_s"] < 3, record.name
        assert -0.5 < doc["command_s"] - doc["setup_s"] - doc["wall_s"] < 3, record.name  # each rounded


def test_the_readmes_sm_configurations_fork_every_case_with_the_same_answers(monkeypatch, tmp_path):
    """The README's `gate --modes audit,plain,sm_margin:16,mps:16` on the final code (h200-sm16-fork-0.34.0-2):
    every case forked, each SM configuration with its own validated reference, the build clean in all four modes and
    a self-control form caught in each."""
    record = RESULTS / "h200-sm16-fork-0.34.0-2"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    # a self control whose first attempt decoded right and whose second crashed keeps the second's result under its
    # own id; this record predates the rows' `attempts`, so the first attempt's exit status is not in it and its replay
    # is not made (records written since keep it: tests/test_gate_attempts_recorded.py replays this run whole)
    later = {k for k, row in rows.items() if any(h["step"] == "self-control attempt" for h in row["result"]["history"])}
    assert (
        later == {f"{V}self-control-smmargin16"} and rows[f"{V}self-control-smmargin16-attempt2"]["verdict"] == "crash"
    )
    kept = {k: r for k, r in rows.items() if not any(k.startswith(x) for x in later)}  # its attempts' rows too
    same_verdicts({k: r for k, r in got.items() if k not in later}, kept)
    (launch,) = doc["launches"].values()
    assert launch["launcher"] == "fork" and launch["spawned"] == 0 and launch["forked"] >= 15
    assert {c.case_id for c, r in run.references if r.verdict == "clean"} == {
        f"{V}under-test-reference-sm-all",
        f"{V}under-test-reference-smmargin16",
        f"{V}under-test-reference-mps16",
    }
    for m in ("audit", "plain", "smmargin16", "mps16"):
        assert got[f"{V}under-test-{m}"].verdict == "clean"
        assert any(got[f"{V}{f}-{m}"].verdict in FAULTS for f in ("self-control", "self-control-stale-descriptor"))
    assert doc["outcome"] == "PASS"  # the replay cannot judge the run whole: the first attempt above is not in it


def test_every_case_forks_from_the_harness_s_one_forkserver_the_readme_gate_cold_and_warm():
    """On the one-forkserver code (h200-readme-gate-15-*, -16-cold): every case process of the bare gate forked from
    its build's forkserver (the harness's one, run/forkserver.py), none spawned, the forkserver ready within its
    import time and CUDA never started in it (the driver's library mapped at most); warm, the run is its import and one case's time (under 60 s)."""
    for record in (ONE_COLD, ONE_WARM, ONE_FINAL):
        doc = json.loads((record / "results.json").read_text())
        (launch,) = doc["launches"].values()
        assert launch["launcher"] == "fork" and launch["spawned"] == 0 and launch["forked"] >= 8, record.name
        fs = launch["forkserver"]
        assert fs["ready_after_s"] - fs["import_s"] < 1 and fs["driver"] in ("not loaded", "loaded"), record.name
    assert json.loads((ONE_WARM / "results.json").read_text())["wall_s"] < 60


@pytest.mark.parametrize("name, sms", [("h200-sm16-fork-0.34.0-3", "16"), ("h200-sm40-mps32-0.34.0", None)])
def test_the_sm_configurations_replay_whole_each_self_control_attempt_included(monkeypatch, tmp_path, name, sms):
    """The README's SM configurations on the one-forkserver code (sm_margin:16 and mps:16), and the first record of
    sm_margin:40 and mps:32 on vLLM 0.34.0, whose sm_margin:40 self control decoded right on its first attempt and
    crashed on its second: replayed whole from their rows' attempts, every verdict and the outcome as recorded; each
    SM configuration with its own validated reference, the build clean and a self-control form caught in each mode."""
    record = RESULTS / name
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    same_verdicts(got, rows, run)  # every attempt of every case too
    assert run.outcome() == doc["outcome"] == "PASS"
    modes = ("audit", "plain", "smmargin16", "mps16") if sms else ("audit", "plain", "smmargin40", "mps32")
    assert {c.case_id for c, r in run.references if r.verdict == "clean"} == {
        f"{V}under-test-reference-{m}" for m in ("sm-all", *modes[2:])
    }
    for m in modes:
        assert got[f"{V}under-test-{m}"].verdict == "clean"
        assert any(got[f"{V}{f}-{m}"].verdict in FAULTS for f in ("self-control", "self-control-stale-descriptor"))
    if not sms:
        tried = run.attempted[f"{V}self-control-smmargin40"]
        assert [(a.verdict, a.returncode) for a in tried] == [("clean", 0), ("crash", 1)]
