"""The three-release gate run recorded on the H200 through the structured channel (results/h200-vllm-release-range:
0.23.0 and 0.26.0 under test, 0.25.1 the control, modes audit and plain), judged again on a CPU: run_gate with each
case process replaced by what it left there — its free-form log and its channel file — so classify, annotate, the
attribution rerun, the reference comparison, the coverage check and repro.judge.policy run as they ran on the H200. The
logs hold no record at all (they went to the channel), and a channel line cut short is an error, never a clean."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from repro.contract.channel import Channel, path_for
from repro.contract.tags import TAGS
from repro.contract.verdicts import CLEAN, ERROR
from repro.vllm_integration.gate.report import build_summary
from repro.vllm_integration.releases import release_range
from tests import recorded_gate
from tests.records import RESULTS

RECORD = RESULTS / "h200-vllm-release-range"
LOGS = RECORD / "logs"
DOC = json.loads((RECORD / "results.json").read_text())
ROWS = {row["case"]: row for row in DOC["cases"]}


def replay(monkeypatch, tmp_path: Path, edit_channel=None):
    return recorded_gate.replay(monkeypatch, tmp_path, RECORD, edit_channel)[2]


def test_records_went_to_the_channel_not_the_log():
    for log in LOGS.glob("*.out.log"):
        text = log.read_text(errors="replace")
        assert not [ln for ln in text.splitlines() if ln.split(" ", 1)[0] in TAGS], log.name
        ch = Channel.read(path_for(log))
        assert ch.records and not ch.problems, log.name


def test_every_recorded_verdict_and_the_range_come_back(monkeypatch, tmp_path):
    run = replay(monkeypatch, tmp_path)
    got = {c.case_id: r for pairs in (run.cases, run.references, run.attributions) for c, r in pairs}
    assert set(got) == set(ROWS)
    for case_id, row in ROWS.items():
        r = got[case_id]
        assert (r.verdict, r.kernel, r.evidence) == (row["verdict"], row["result"]["kernel"], row["result"]["evidence"])
        assert r.history == row["result"]["history"], case_id  # the same steps changed the same records
    rels = release_range.releases(build_summary(run))
    assert [(x.build, x.gpu) for x in rels] == [("0.23.0", "bad"), ("0.25.1", "bad"), ("0.26.0", "good")]
    assert release_range.transitions(rels) == DOC["release_range"]["transitions"]
    assert DOC["release_range"]["transitions"] == ["fixed: last bad 0.25.1, first good 0.26.0"]
    assert run.outcome() == DOC["outcome"] == "AFFECTED"  # 0.23.0, under test, is affected


def test_a_record_cut_short_is_an_error_not_a_clean(monkeypatch, tmp_path):
    victim = "stale_metadata-vllm-0.26.0-under-test-plain"
    assert ROWS[victim]["verdict"] == CLEAN

    def cut(case_id, records):
        return records[: records.rindex('"data"') + 9] + "\n" if case_id == victim else records

    run = replay(monkeypatch, tmp_path, cut)
    r = next(r for c, r in run.cases if c.case_id == victim)
    assert r.verdict == ERROR and "channel: line" in r.reason


@pytest.mark.parametrize("case_id", sorted(c for c in ROWS if ROWS[c]["kind"] == "case"))
def test_history_says_what_changed_each_record(case_id):
    hist = ROWS[case_id]["result"]["history"]
    for h in hist:
        assert h["step"] and h["why"] and h["changed"]
    if ROWS[case_id]["verdict"] == CLEAN:
        assert [h["step"] for h in hist] == ["reference comparison"] and "verdict" not in hist[0]["changed"]
