"""The whole hidden-configuration sweep in one run (results/h200-hidden-sweep-full: `gate --modes hidden-sweep`,
0.26.0 against 0.25.1, the full GPU and sm_margin and MPS at 8, 16, 24, 40 and 66 SMs, audit and plain in each, no
torch.compile, 247 s), judged again on a CPU: no false alarm on 0.26.0 and no miss on 0.25.1 wherever the platform
computes right; at MPS 24 and 40 SMs the processes found bf16 products wrong, so neither build is judged there and the
gate cannot vouch for those configurations."""

from __future__ import annotations

from repro.vllm_integration.gate.modes import PRESETS
from tests.recorded_gate import replay
from tests.records import RESULTS

BROKEN = ("mps:24", "audit+mps:24", "mps:40", "audit+mps:40")  # the platform check failed there


def _label(mode: str) -> str:
    return mode.replace("sm_margin:", "smmargin").replace(":", "-").replace("mps-", "mps").replace("+", "-")


def test_no_false_alarm_and_no_miss_where_the_platform_is_right(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-hidden-sweep-full")
    assert {k: r.verdict for k, r in got.items()} == {k: row["verdict"] for k, row in rows.items()}
    for mode in PRESETS["hidden-sweep"]:
        good = got[f"stale_metadata-vllm-0.26.0-under-test-compile-none-{_label(mode)}"]
        bad = got[f"stale_metadata-vllm-0.25.1-control-compile-none-{_label(mode)}"]
        if mode in BROKEN:
            assert good.verdict == bad.verdict == "error" and "bf16" in good.reason + bad.reason, mode
        else:
            assert good.verdict == "clean", mode
            assert bad.verdict in ("crash", "hang", "wrong-output", "stale-audit", "oob"), mode
    assert run.outcome() == doc["outcome"] == "CANNOT VOUCH"
    assert doc["wall_s"] < 300
