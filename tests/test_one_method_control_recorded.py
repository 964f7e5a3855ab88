"""vLLM 0.33.0 on the H100 (results/h100-scenarios-mutants-0.33.0): the release with eagle, dflash, eagle_sleep2 and
eagle_dynamic_k, every self-control form (stale-refresh too), and two source mutants as known-bad controls: the
refresh computed for the previous step (every method) and the DFlash builder's wrong descriptor (dflash only). The
run ended HARNESS BLIND because the DFlash mutant was clean with the EAGLE methods; judged again on a CPU from its
records, the build is caught where its capture path runs and the run passes, each clean method listed."""

from __future__ import annotations

from repro.exit_codes import gate as gate_exit
from tests.recorded_gate import replay
from tests.records import RESULTS

RECORD = RESULTS / "h100-scenarios-mutants-0.33.0"
V = "stale_metadata-vllm-"


def test_a_control_bad_on_one_capture_path_is_caught_there_and_the_run_passes(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RECORD)
    assert {k: r.verdict for k, r in got.items()} == {
        k: row["verdict"] for k, row in rows.items() if "-attempt" not in k
    }
    assert {c.case_id: r.verdict for c, r in run.attempts} == {
        k: row["verdict"] for k, row in rows.items() if "-attempt" in k
    }
    assert doc["outcome"] == "HARNESS BLIND"  # as the run decided it, before rule 5 judged a build over its methods
    verdicts = {k: r.verdict for k, r in got.items()}
    dfl = f"{V}0.33.0-dflash-wrong-descriptor-control"
    assert [verdicts[f"{dfl}-dflash-{m}"] for m in ("audit", "plain")] == ["wrong-output"] * 2
    assert [verdicts[f"{dfl}-{m}"] for m in ("audit", "plain")] == ["clean", "clean"]  # eagle: another path
    rp = f"{V}0.33.0-refresh-previous-step-control"
    assert [verdicts[f"{rp}-{m}"] for m in ("audit", "plain")] == ["stale-audit", "clean"]
    assert run.outcome() == "PASS" and gate_exit(run.outcome()) == 0, run.blind()
    misses = run.decision().misses
    assert f"{dfl}-audit: clean (not with eagle FLASH_ATTN; detected with dflash FLASH_ATTN)" in misses
    assert (
        f"{dfl}-eagle-sleep2-plain: clean (not with eagle_sleep2 FLASH_ATTN; detected with dflash FLASH_ATTN)" in misses
    )
    assert f"{rp}-plain: clean (detected in audit)" in misses


def test_the_report_marks_a_method_the_control_leaves_clean_ok_and_a_build_silent_everywhere_fail(
    monkeypatch, tmp_path
):
    from repro.vllm_integration.gate.report import rows as report_rows

    doc, rows, run, got = replay(monkeypatch, tmp_path, RECORD)
    run.judge()
    ok = {r["case"]: r["ok"] for r in report_rows(run) if r["kind"] == "case"}
    dfl = f"{V}0.33.0-dflash-wrong-descriptor-control"
    assert all(v for k, v in ok.items() if k.startswith(dfl)), {k: v for k, v in ok.items() if not v}
    # the same run with the DFlash mutant's caught cases silent: the build fails, every method's row with it
    for c, r in run.cases:
        if c.case_id.startswith(f"{dfl}-dflash-"):
            r.verdict = "clean"
    # and one of its cases a recorded memcheck finding (no gating control): no evidence for rule 5, nor for the report
    recorded = next(r for c, r in run.cases if c.case_id == f"{dfl}-dflash-plain")
    recorded.verdict, recorded.expected = "oob", "recorded"
    run.judgment = None
    assert run.judge().outcome == "HARNESS BLIND"
    ok = {r["case"]: r["ok"] for r in report_rows(run) if r["kind"] == "case"}
    assert not any(
        v for k, v in ok.items() if k.startswith(dfl) and "dynamic-k" not in k and k != f"{dfl}-dflash-plain"
    )
