"""The gate's classification and token comparison on what real vLLM printed on the H200 (results/h200-vllm/*/results.json:
each case's last output lines, its spec, and the recorded verdict). Re-deriving the verdicts from the recorded output
with today's code must give the recorded verdicts."""

from __future__ import annotations

import json

import pytest

from repro.contract.channel import Channel
from repro.contract.tags import AUDIT_TAG, RESULT_TAG
from repro.contract.verdicts import CLEAN, CRASH, ERROR
from repro.judge.classify import classify, kernel_in
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.judge import compare_tokens
from tests.records import RESULTS

RECORDS = sorted((RESULTS / "h200-vllm").glob("*/results.json"))
ROWS = [(p.parent.name, c) for p in RECORDS for c in json.loads(p.read_text())["cases"]]


def _result(tail: str) -> dict | None:
    found = Channel.from_output(tail).of(RESULT_TAG)
    return found[-1] if found else None


def test_records_are_there():
    assert len(RECORDS) >= 8 and len(ROWS) >= 50


@pytest.mark.parametrize("run,row", ROWS, ids=[f"{r}-{c['case'].split('-vllm-')[1]}-{c['kind']}" for r, c in ROWS])
def test_recorded_output_classifies_as_recorded(run, row):
    r = row["result"]
    case = GateCase.from_dict(r["spec"])
    assert case.case_id == row["case"]
    res = classify(case, r["log_tail"], r["returncode"], False, None, r["wall_s"])
    if r["verdict"] == CRASH:
        assert res.verdict == CRASH and "illegal memory access" in res.reason
    elif r["verdict"] == ERROR and "memcheck-async" in row["case"]:  # cudaMallocAsync + memcheck: driver error
        assert res.verdict == ERROR and "invalid argument" in r["log_tail"]
    elif r["verdict"] == CLEAN:
        assert res.verdict == CLEAN and _result(r["log_tail"])["tokens"]
    else:
        pytest.fail(f"recorded verdict {r['verdict']} of {row['case']}: no check for it here")
    if row["kind"] == "attribution":  # the launch-blocking rerun names the kernel on its faulting line
        fault = next(ln for ln in r["log_tail"].splitlines() if "illegal memory access" in ln)
        assert res.kernel == kernel_in(fault) == "combine"


def test_recorded_0_26_0_tokens_match_the_reference_up_to_ties():
    """No false positive on 0.26.0: in every recorded run, every mode's tokens equal the reference's until a tie."""
    checked = 0
    for p in RECORDS:
        rows = json.loads(p.read_text())["cases"]
        refs = {(c["build"], c["sm"]): _result(c["result"]["log_tail"]) for c in rows if c["kind"] == "reference"}
        for c in rows:
            if c["kind"] != "case" or c["verdict"] != CLEAN:
                continue
            ref = refs[(c["build"], c["sm"])]
            chk = compare_tokens(_result(c["result"]["log_tail"])["tokens"], ref["tokens"], ref["margins"])
            assert not chk.wrong and chk.coverage >= 0.5, (c["case"], chk.describe())
            assert chk.describe() in c["evidence"]
            checked += 1
    assert checked >= 15


def test_recorded_audit_counts_stale_views_on_0_25_1_only():
    for _, c in ROWS:
        if c["mode"] != "audit" or c["kind"] != "case":
            continue
        summary = [x for x in Channel.from_output(c["result"]["log_tail"]).of(AUDIT_TAG) if "checks" in x][-1]
        assert summary["checks"] > 0
        if c["build"] == "0.25.1":
            assert summary["stale"] > 100 and c["verdict"] == CRASH
        else:
            assert summary["stale"] == 0 and c["verdict"] == CLEAN
