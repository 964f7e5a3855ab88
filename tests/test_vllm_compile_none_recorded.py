"""The gate with no torch.compile on the H200 (results/h200-compile-none, h200-fast-cold, h200-fast-warm: FULL CUDA
graphs of the eager model, the engine's compilation mode NONE in every speculative case), judged again on a CPU from
its records: the same verdicts; 0.26.0 clean with its draft accepted, its self control caught, and 0.25.1 caught in
plain by a fault in FA3's combine kernel, where with inductor its plain mode decodes right (h200-readme-gate-4)."""

from __future__ import annotations

import pytest

from tests.recorded_gate import replay
from tests.records import RESULTS

V = "stale_metadata-vllm-"
# the warm run took its reference from the cache the cold run had just written (its out.log says so)
WARM_KEPT_FROM = (RESULTS / "h200-fast-cold" / "logs",)


def _engine(result) -> dict:
    return (result.backend_identity or {}).get("engine") or {}


@pytest.mark.parametrize("record", ["h200-compile-none", "h200-fast-cold", "h200-fast-warm"])
def test_the_records_without_torch_compile_replay_to_their_verdicts(monkeypatch, tmp_path, record):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / record, more_logs=WARM_KEPT_FROM)
    assert {k: r.verdict for k, r in got.items()} == {k: row["verdict"] for k, row in rows.items()}
    clean = [got[f"{V}0.26.0-under-test-{m}"] for m in ("audit", "plain")]
    assert all(r.verdict == "clean" and "48 of 48 draft tokens accepted" in r.evidence for r in clean)
    assert all((_engine(r)["compilation_mode"], _engine(r)["cudagraph_mode"]) == ("NONE", "FULL") for r in clean)


def test_without_torch_compile_the_known_bad_build_faults_in_plain_too(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-compile-none")
    plain = got[f"{V}0.25.1-control-plain"]
    assert plain.verdict == "crash" and plain.kernel == "combine"
    assert got[f"{V}0.25.1-control-audit"].verdict == "crash" and got[f"{V}0.25.1-control-audit"].stale_fields
    with_inductor = {
        r["case"]: r for r in replay(monkeypatch, tmp_path / "i", RESULTS / "h200-readme-gate-4")[0]["cases"]
    }
    assert with_inductor[f"{V}0.25.1-control-plain"]["verdict"] == "clean"  # the same build, inductor: silent
    # memcheck:async errs before any replay in both builds: a route that cannot show the bug is never clean
    assert {got[f"{V}{b}-memcheck-async"].verdict for b in ("0.26.0-under-test", "0.25.1-control")} == {"error"}
    assert run.outcome() == doc["outcome"] == "CANNOT VOUCH"


def test_a_build_and_its_self_control_without_torch_compile_pass_cold_and_warm(monkeypatch, tmp_path):
    for record in ("h200-fast-cold", "h200-fast-warm"):
        doc, rows, run, got = replay(monkeypatch, tmp_path / record, RESULTS / record, more_logs=WARM_KEPT_FROM)
        assert {got[f"{V}0.26.0-self-control-{m}"].verdict for m in ("audit", "plain")} == {"crash"}
        assert run.outcome(need_control=False) == doc["outcome"] == "PASS"
    assert doc["wall_s"] < 60  # warm (the gate's own figure; cold: see results/README.md)
