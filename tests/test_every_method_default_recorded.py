"""The bare `gate` (every method, inductor, both self-control forms) on an H100 80GB, judged again on a CPU from the
records it wrote with scripts/bench-gate.sh (results/h100-gate-default-3-cold and -warm; -5-cold, -warm and -kept
on code c376f46, replayed under every later policy; vLLM 0.34.0 on torch 2.14):
every method's build clean in audit and plain, every self control form caught in audit and at least one per method
in plain (policy rule 6), and no self control's crash rerun to name its kernel (GateCase.name_kernel), in the record
or in its replay."""

from __future__ import annotations

import pytest

from repro.exit_codes import gate as gate_exit
from tests.recorded_gate import FAULTS, replay, same_verdicts
from tests.records import RESULTS

V = "stale_metadata-vllm-0.34.0-"
METHOD_IDS = ("", "eagle3-", "draft-model-", "mtp-", "dflash-")  # eagle's ids name no method
FORMS = ("self-control", "self-control-stale-descriptor")
CAUGHT = (*FAULTS, "wrong-output", "stale-audit")


@pytest.mark.parametrize(
    "record",
    [
        "h100-gate-default-3-cold",
        "h100-gate-default-3-warm",
        *(f"h100-gate-default-5-{r}" for r in ("cold", "warm", "kept")),
    ],
)
def test_every_method_is_clean_and_its_self_control_caught_under_inductor(monkeypatch, tmp_path, record):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / record)
    same_verdicts(got, rows, run)
    assert run.outcome() == doc["outcome"] == "PASS" and gate_exit(run.outcome()) == 0
    for m in METHOD_IDS:
        assert [got[f"{V}under-test-{m}{mode}"].verdict for mode in ("audit", "plain")] == ["clean", "clean"], m
        assert all(got[f"{V}{form}-{m}audit"].verdict in CAUGHT for form in FORMS), m
        assert any(got[f"{V}{form}-{m}plain"].verdict in CAUGHT for form in FORMS), m
    # a self control's crash was not rerun with CUDA_LAUNCH_BLOCKING=1: no such process ran, none was replayed
    assert not any(k.endswith("-launch-blocking") for k in rows) and not run.attributions
    crashed = [got[k] for k in got if "-self-control" in k and k.endswith("-plain") and got[k].verdict == "crash"]
    assert crashed and all(r.kernel is None for r in crashed)  # the crash is the evidence, no kernel named


def test_every_method_with_two_sm_configurations_passes_each_mode_caught(monkeypatch, tmp_path):
    """`gate --modes audit,plain,sm_margin:16,mps:16` (every method, inductor) on the H100, empty cache
    (results/h100-gate-sm-1207-cold: 230 s, under 240 s): judged again under the current policy."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h100-gate-sm-1207-cold")
    same_verdicts(got, rows, run)
    assert run.outcome() == doc["outcome"] == "PASS" and gate_exit(run.outcome()) == 0
    assert doc["wall_s"] < 240
    for m in METHOD_IDS:
        for mode in ("audit", "plain", "smmargin16", "mps16"):
            assert got[f"{V}under-test-{m}{mode}"].verdict == "clean", (m, mode)
            assert any(got[f"{V}{form}-{m}{mode}"].verdict in CAUGHT for form in FORMS), (m, mode)
