"""The H200 records of this round's vLLM gate runs, judged again on a CPU: the five-release sweep (0.24.0 and 0.25.0
as Python-source overlays) replayed through run_gate from its logs and channel files gives back every verdict and
the affected range; the TRITON_ATTN run's verdicts come back the same way; the phase split recomputed from the warm
run's logs is the one its paths.md shows."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from repro import smcontrol
from repro.channel import Channel, path_for
from repro.classify import classify
from repro.tags import RESULT_TAG
from repro.vllm_integration import gate_bench, gate_run, release_range
from repro.vllm_integration.gate_case import GateCase, parse_backends, parse_modes
from repro.vllm_integration.gate_report import build_summary
from repro.vllm_integration.gate_run import run_gate

RESULTS = Path(__file__).resolve().parent.parent / "results"


def replay(monkeypatch, tmp_path: Path, record: Path):
    doc = json.loads((record / "results.json").read_text())
    rows = {row["case"]: row for row in doc["cases"]}
    logs = record / "logs"
    monkeypatch.setattr(smcontrol, "_sm_count", lambda env: int(doc["environment"]["sms"]))

    def recorded_process(case, cmd, env, log_dir, sanitizer, executor=None, target=None):
        r = rows[case.case_id]["result"]
        out_log = Path(log_dir) / f"{case.case_id}.out.log"
        out = (logs / out_log.name).read_text(errors="replace")
        out_log.write_text(out)
        shutil.copy(logs / path_for(out_log).name, path_for(out_log))
        audit = logs / f"{case.case_id}.audit.json"
        if audit.exists():
            shutil.copy(audit, Path(log_dir) / audit.name)
        return classify(case, out, r["returncode"], False, None, r["wall_s"], Channel.read(path_for(out_log))), out

    monkeypatch.setattr(gate_run, "run_process", recorded_process)
    builds = {}
    for row in doc["cases"]:
        b = GateCase.from_dict(row["result"]["spec"]).build
        builds.setdefault(b.label, b)
    command = doc["environment"]["command"]
    modes = parse_modes(re.search(r"--modes (\S+)", command)[1])
    backends = parse_backends(m[1]) if (m := re.search(r"--backends (\S+)", command)) else ("FLASH_ATTN",)
    run = run_gate(list(builds.values()), modes, tmp_path / "logs", jobs=4, timeout_s=240.0, backends=backends)
    got = {c.case_id: r for pairs in (run.cases, run.references, run.attributions) for c, r in pairs}
    return doc, rows, run, got


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
    """The open question of issue 21, answered on the H200: 0.25.1 with TRITON_ATTN bakes stale views into the draft's
    graphs (the auditor) but neither faults nor changes a decided token (the plain mode sees nothing)."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-vllm-backends")
    for case_id, row in rows.items():
        if "launch-blocking" not in case_id:  # that rerun hit the copied-cache fault (results/README.md)
            assert got[case_id].verdict == row["verdict"], case_id
    audit = got["stale_metadata-vllm-0.25.1-control-triton_attn-audit"]
    assert audit.verdict == "stale-audit" and "192 stale fields in 360 checks" in audit.evidence
    assert got["stale_metadata-vllm-0.25.1-control-triton_attn-plain"].verdict == "clean"
    assert got["stale_metadata-vllm-0.26.0-under-test-triton_attn-audit"].verdict == "clean"
    assert run.outcome() == "HARNESS BLIND"  # the plain mode's TRITON_ATTN control shows no kernel evidence


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
