"""The MPS half of the hidden-configuration sweep for the build under test (results/h200-sweep-mps-c: 0.26.0, audit
and plain at MPS 8, 16, 24, 40 and 66 SMs, no torch.compile, 66 s), judged again on a CPU: no false alarm. It is clean
where the platform computes right (8, 16, 66 SMs) and an error where the process found bf16 products wrong (24, 40 SMs:
a configuration the gate cannot vouch for, never a verdict about the build)."""

from __future__ import annotations

from tests.recorded_gate import replay
from tests.records import RESULTS

V = "stale_metadata-vllm-0.26.0-under-test-compile-none-"


def test_the_build_under_test_gives_no_false_alarm_in_any_mps_configuration(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-sweep-mps-c")
    assert {k: r.verdict for k, r in got.items()} == {k: row["verdict"] for k, row in rows.items()}
    for n in (8, 16, 66):
        for m in (f"audit-mps{n}", f"mps{n}"):
            assert got[V + m].verdict == "clean", m
    for n in (24, 40):
        for m in (f"audit-mps{n}", f"mps{n}"):
            assert got[V + m].verdict == "error" and "bf16" in got[V + m].reason, m
    assert not any(r.verdict in ("crash", "wrong-output", "stale-audit", "oob", "hang") for r in got.values())
    assert run.outcome(need_control=False) == doc["outcome"] == "CANNOT VOUCH"
