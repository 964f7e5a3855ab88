"""Kept forkservers (`gate --keep-forkserver`) meet the per-build goals with the old path's verdicts, on the
H200 records results/h200-paths-kept and results/h200-paths-kept-2."""

from __future__ import annotations

import json

from tests.records import RESULTS

V = "stale_metadata-vllm-"


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


def test_kept_forkservers_meet_the_per_build_goals_again_on_this_code():
    # results/h200-paths-kept-2: the kept paths measured again on later code, with the verdicts
    # of results/h200-paths-kept's old path
    doc = json.loads((RESULTS / "h200-paths-kept-2" / "paths.json").read_text())
    before = json.loads((RESULTS / "h200-paths-kept" / "paths.json").read_text())["paths"]["old"]
    paths = doc["paths"]
    assert list(paths) == ["kept (cold)", "kept (warm)"] and "--compile none" in doc["environment"]["command"]
    verdicts = {p: {c: e["verdict"] for c, e in v["cases"].items()} for p, v in {**paths, "old": before}.items()}
    assert verdicts["old"] == verdicts["kept (cold)"] == verdicts["kept (warm)"]
    assert {v["outcome"] for v in paths.values()} == {"PASS"}
    assert paths["kept (cold)"]["build_wall_s"]["0.26.0"] < 60 and paths["kept (warm)"]["build_wall_s"]["0.26.0"] < 30
    cold, warm = (paths[p]["launches"]["0.26.0"] for p in ("kept (cold)", "kept (warm)"))
    assert cold["forkserver"]["pid"] == warm["forkserver"]["pid"] and warm["forkserver"]["kept"]["reused"]
