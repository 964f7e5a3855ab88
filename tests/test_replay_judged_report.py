"""The reports say what the replay check and the refresh judging judged, never a PASS read as "replays were checked":
per build in the gate's verdicts.md ("What each build's cases checked") and results.json, and in `repro audit`'s
summary, its verdicts.md and results.json: replays judged and left unjudged (the most common reason), refreshed fields
judged and left unjudged, or "replay check off: <reason>". A check that judged 0 replays says "0 judged". Stand-in
counters as the plugin writes them (plugin.counters), stand-in gate runs and audit records (no GPU)."""

from __future__ import annotations

import copy
import json

from repro.case.spec import CaseResult
from repro.contract.verdicts import CLEAN
from repro.judge.decision import GateOutcome
from repro.vllm_integration.ci import report as audit_report
from repro.vllm_integration.ci.judge import Expect, judge
from repro.vllm_integration.gate import report as gate_report
from repro.vllm_integration.gate.checked import judged
from repro.vllm_integration.plugin import refresh, replay
from tests.test_audit_judge import CLEAN as AUDIT_CLEAN
from tests.test_reports_say_why import _stand_in_run

TORCH_OFF = "off: torch 2.10 has no torch.cuda.graphs.register_graph_replay_start_hook (torch 2.14 on)"
# vLLM 0.34.0 on FLASH_ATTN, as the review saw it: the fused draft decode graph's replays have no build to judge by
FUSED_ONLY = {"replay_check": "on", "replay_graphs": 8, "replays_seen": 120, "replay_checks": 0,
              "replay_unjudged": {replay.NO_BUILD: 40}, "refresh_judging": "on", "refresh_checks": 0,
              "refresh_stale": 0, "refresh_unjudged": {}}  # fmt: skip
PREFILL_JUDGED = {**FUSED_ONLY, "replay_checks": 6, "replay_unjudged": {replay.NO_BUILD: 40, replay.OTHER_GRAPH: 2,
                  "block_table": 3}, "refresh_checks": 17, "refresh_unjudged": {"FLASH_ATTN.x": 1}}  # fmt: skip


def test_a_replay_check_that_judged_no_replay_says_0_judged_and_why_never_clean():
    r = judged([FUSED_ONLY])["replay"]
    assert r["judged"] == 0 and r["seen"] == 120 and r["unjudged"] == 40 and r["top_reason"] == replay.NO_BUILD
    assert r["words"].startswith("0 judged of 120 replays seen (nothing checked at replay), 40 sampled and left")
    assert replay.NO_BUILD in r["words"] and "clean" not in r["words"]


def test_replays_judged_and_unjudged_are_counted_apart_from_views_no_build_wrote():
    r = judged([PREFILL_JUDGED, {**FUSED_ONLY, "replay_checks": 2}])["replay"]
    assert r["judged"] == 8 and r["seen"] == 240 and r["unjudged"] == 82  # replays: 40 + 2 + 40
    assert r["unjudged_by_reason"] == {replay.NO_BUILD: 80, replay.OTHER_GRAPH: 2}
    assert r["views_unjudged"] == {"block_table": 3} and "3 view(s) no build wrote" in r["words"]
    assert r["words"].startswith("8 judged of 240 replays seen, 82 sampled and left unjudged (most: " + replay.NO_BUILD)


def test_a_replay_check_that_is_off_says_so_with_its_reason():
    assert judged([{"replay_check": replay.OFF}])["replay"]["words"] == (
        "replay check off: the request asks for no replay check (check_replay false)"
    )
    words = judged([{"replay_check": TORCH_OFF}])["replay"]["words"]
    assert words.startswith("replay check off: torch 2.10 has no torch.cuda.graphs.register_graph_replay_start_hook")
    mixed = judged([FUSED_ONLY, {"replay_check": replay.OFF}])["replay"]["words"]
    assert mixed.startswith("0 judged") and mixed.endswith("check_replay false) (in 1 of 2 reports)"), mixed
    assert judged([{}])["replay"]["words"] == "replay check not reported"  # a record from before the counter


def test_the_refresh_judging_says_what_it_judged_left_unjudged_or_that_it_was_off():
    f = judged([PREFILL_JUDGED])["refresh"]
    assert (f["judged"], f["stale"], f["unjudged"], f["top_reason"]) == (17, 0, 1, "FLASH_ATTN.x")
    assert f["words"] == "17 refreshed field(s) judged, 0 stale, 1 unjudged (most: FLASH_ATTN.x: 1)"
    assert judged([FUSED_ONLY])["refresh"]["words"].startswith("0 refreshed field(s) judged (no refresh judged)")
    off = judged([{"refresh_judging": refresh.OFF, "refresh_unjudged": {"FLASH_ATTN.x": 4}}])["refresh"]
    assert off["words"] == "refresh judging off: the request asks for no refresh judging (judge_refresh false)"
    assert off["unjudged"] == 4


def _audit(counters: dict):
    d = copy.deepcopy(AUDIT_CLEAN)
    d["processes"][1]["counters"].update(counters)
    return judge(d, [{"pid": 1}, {"pid": 2}], Expect())


def test_repro_audit_s_summary_says_a_pass_checked_no_replay(tmp_path):
    j = _audit(FUSED_ONLY)
    assert j.outcome == GateOutcome.PASS and j.replay["judged"] == 0  # the capture-time checks answer; not the replay's
    text = "\n".join(audit_report.lines(j, None, 0))
    assert "replay check: 0 judged of 120 replays seen" in text and replay.NO_BUILD in text
    assert "this PASS rests on the capture-time checks: 0 replays judged" in text
    assert "refresh judging: 0 refreshed field(s) judged" in text
    md = audit_report.markdown(j, None, 0)
    assert "- replay check: 0 judged of 120 replays seen" in md and "- refresh judging: 0 refreshed" in md
    audit_report.write(tmp_path, j, None, 0, None)
    doc = json.loads((tmp_path / "results.json").read_text())["judgement"]
    assert doc["replay"]["judged"] == 0 and doc["replay"]["top_reason"] == replay.NO_BUILD
    assert doc["refresh"]["judged"] == 0 and doc["replay"]["words"].startswith("0 judged")


def test_repro_audit_s_summary_says_the_replay_check_was_off_and_why():
    j = _audit({"replay_check": replay.OFF, "refresh_judging": refresh.OFF})
    text = "\n".join(audit_report.lines(j, None, 0))
    assert "replay check: replay check off: the request asks for no replay check" in text
    assert "refresh judging: refresh judging off: the request asks for no refresh judging" in text
    judged_ones = _audit(PREFILL_JUDGED)
    assert "this PASS rests" not in "\n".join(audit_report.lines(judged_ones, None, 0))


def test_the_gate_s_report_says_per_build_what_was_judged_at_replay_and_refresh(monkeypatch, tmp_path):
    def answer(case):
        counters = {**FUSED_ONLY, "checks": 5}
        return CaseResult(case.case_id, CLEAN, "stand-in", backend_identity={"counters": counters})

    run = _stand_in_run(monkeypatch, tmp_path, "audit,plain", answer)
    md = gate_report.markdown(run)
    table = md[md.index("What each build's cases checked") :].splitlines()
    assert "judged at replay / refresh" in table[2]
    row = next(ln for ln in table if ln.startswith("| 0.34.0"))
    n = sum(1 for c, _ in run.cases if c.build.label == "0.34.0")  # each case reports the stand-in's counters
    assert n == 2 and f"| {5 * n} |" in row
    assert f"replay: 0 judged of {120 * n} replays seen (nothing checked at replay)" in row, row
    assert "refresh: 0 refreshed field(s) judged" in row, row
    build = next(b for b in gate_report.to_json(run)["builds"] if b["build"] == "0.34.0")
    assert build["coverage"]["replay"]["judged"] == 0 and build["coverage"]["replay"]["unjudged"] == 40 * n
    assert build["coverage"]["replay"]["top_reason"] == replay.NO_BUILD
