"""The README's GPU CI line as recorded on the H200 after the xdist fix (results/h200-ci-line-n8, -n4, -n1; written by
scripts/gpu-evidence.sh ci-line): every worker count ran every case, the gate passed, and the verdicts are the same
case by case whatever the number of workers; h200-ci-line-final(-2) is the line again on a session's last code, and
h200-ci-line-last-n8 / -n4 on the last code of the session after (both worker counts); h200-ci-line-3-n8 / -n4 after
the gate case request became one typed record and pytest --gate chose its failure line by kind; h200-ci-line-4-n8 on
the code where the fork launcher became the default and the spec-decode case got its own worker; h200-ci-line-5-n8 on that
day's final code (hangs before the captures no evidence, the new user's fifth round, records carrying their code);
h200-ci-line-7-n8 on the one-forkserver code (14085c4: the pytest tier's cases forked from the harness's forkserver)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

from tests.records import RESULTS

WORKERS = (8, 4, 1)
LATER = {
    "final": 8,
    "final-2": 8,
    "last-n8": 8,
    "last-n4": 4,
    "3-n8": 8,
    "3-n4": 4,
    "4-n8": 8,
    "5-n8": 8,
    "6-n8": 8,
    "6-n4": 4,
    "7-n8": 8,
}  # records of later code: name -> workers


def _record(n: int | str) -> tuple[dict, dict[str, dict]]:
    folder = RESULTS / (f"h200-ci-line-n{n}" if isinstance(n, int) else f"h200-ci-line-{n}")
    gate = json.loads((folder / "gate.json").read_text())
    cases = {}
    for tc in ET.parse(folder / "junit.xml").getroot().iter("testcase"):
        cases[tc.get("name")] = {p.get("name"): p.get("value") for p in tc.iter("property")}
    return gate, cases


@pytest.mark.parametrize("n", [*WORKERS, *LATER], ids=lambda n: f"n{n}" if isinstance(n, int) else n)
def test_the_ci_line_passed_with_every_case_run_at_each_worker_count(n):
    gate, cases = _record(n)
    n = LATER[n] if isinstance(n, str) else n  # a later session's code: the worker count it ran with
    assert gate["outcome"] == "GATE PASSED" and gate["passed"] is True and not gate["unreported"]
    assert f"-n {n} --gate" in gate["environment"]["command"] and gate["environment"]["gpu"] == "NVIDIA H200"
    assert len(gate["controls"]) == len(cases) == 95
    ran = [c for c in gate["controls"] if not c["not_applicable"]]
    assert len(ran) == 78 and all(c["verdict"] != "skip" for c in ran)
    workers = {p["xdist_worker"] for p in cases.values() if "xdist_worker" in p}
    assert workers == {f"gw{i}" for i in range(n)}  # every worker ran cases, none died
    for mode, got in gate["evidence_by_mode"].items():
        assert got["positive"] and got["with_evidence"] == got["positive"], mode


def test_the_verdicts_are_equal_across_worker_counts():
    verdicts = {n: {c["case_id"]: c["verdict"] for c in _record(n)[0]["controls"]} for n in (*WORKERS, *LATER)}
    assert all(v == verdicts[8] for v in verdicts.values()), {n: len(v) for n, v in verdicts.items()}
    assert {"crash", "oob", "clean"} <= set(verdicts[8].values())
