"""The H200 records of this round's vLLM gate runs, judged again on a CPU: the five-release sweep (0.24.0 and 0.25.0
as Python-source overlays) replayed through run_gate from its logs and channel files gives back every verdict and
the affected range; the TRITON_ATTN run's verdicts come back the same way; the phase split recomputed from the warm
run's logs is the one its paths.md shows."""

from __future__ import annotations

import json

import pytest

from repro.contract.channel import Channel, path_for
from repro.contract.tags import RESULT_TAG
from repro.vllm_integration.gate import bench as gate_bench
from repro.vllm_integration.gate.report import build_summary
from repro.vllm_integration.releases import release_range
from tests.recorded_gate import replay
from tests.records import RESULTS


def test_the_five_release_sweep_comes_back(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-vllm-release-sweep")
    assert set(got) == set(rows)
    for case_id, row in rows.items():
        assert (got[case_id].verdict, got[case_id].kernel) == (row["verdict"], row["result"]["kernel"]), case_id
    rels = release_range.releases(build_summary(run))
    order = ["0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0"]
    assert [(x.build, x.gpu) for x in rels] == [(v, "good" if v == "0.26.0" else "bad") for v in order]
    recorded = doc["release_range"]["releases"]  # the source check ran beside the GPU there (here: no prefixes)
    assert [(x["build"], x["source"], x["disagrees"]) for x in recorded] == [(x.build, x.gpu, False) for x in rels]
    assert release_range.transitions(rels) == ["fixed: last bad 0.25.1, first good 0.26.0"]
    assert "--overlay 0.24.0=" in doc["environment"]["command"] and run.outcome() == "AFFECTED"


def test_triton_attn_on_0251_is_stale_but_silent(monkeypatch, tmp_path):
    """Does another attention backend show the bug? Answered on the H200: 0.25.1 with TRITON_ATTN bakes stale views into the draft's
    graphs (the auditor) but neither faults nor changes a decided token (the plain mode sees nothing)."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-vllm-backends")
    for case_id, row in rows.items():
        if "launch-blocking" not in case_id:  # that rerun hit the copied-cache fault (results/README.md)
            assert got[case_id].verdict == row["verdict"], case_id
    audit = got["stale_metadata-vllm-0.25.1-control-triton_attn-audit"]
    assert audit.verdict == "stale-audit" and "192 stale fields in 360 checks" in audit.evidence
    assert got["stale_metadata-vllm-0.25.1-control-triton_attn-plain"].verdict == "clean"
    assert got["stale_metadata-vllm-0.26.0-under-test-triton_attn-audit"].verdict == "clean"
    # recorded as HARNESS BLIND (the plain mode's TRITON_ATTN control showed no kernel evidence); under policy rule 5
    # that is a listed miss: 0.25.1 on TRITON_ATTN was caught by its audit, and the plain mode has the FLASH_ATTN
    # control's crash as its evidence
    assert doc["outcome"] == "HARNESS BLIND" and run.outcome() == "PASS"
    assert run.decision().misses == ["stale_metadata-vllm-0.25.1-control-triton_attn-plain: clean (detected in audit)"]


@pytest.mark.parametrize("path", ["new-cold", "new-warm"])
def test_phases_in_paths_md_are_what_the_logs_say(path):
    record = RESULTS / "h200-vllm-paths-3"
    doc = json.loads((record / "paths.json").read_text())
    cases = doc["paths"][{"new-cold": "new (cold)", "new-warm": "new (warm)"}[path]]["cases"]
    checked = 0
    for case_id, entry in cases.items():
        log = record / "logs" / path / f"{case_id}.out.log"
        if not log.exists():  # a kept reference: no process ran
            assert entry["phases"]["vllm_cache"] == "reference kept"
            continue
        result = Channel.read(path_for(log)).last(RESULT_TAG)
        now = gate_bench.phases(log.read_text(errors="replace"), result, None, entry["phases"]["wall"])
        for k in ("import", "config", "compile", "capture", "engine_rest", "decode", "compile_loaded"):
            assert now.get(k) == entry["phases"].get(k), (case_id, k)
        checked += 1
    assert checked >= 5
    if path == "new-warm":
        assert all(e["phases"].get("compile_loaded") == 4 for c, e in cases.items() if "reference" not in c)
