"""The audit file (REPRO_AUDIT_FILE, a request's audit_file) of a person's vLLM run with its multi-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default): every process vLLM starts loads the plugin and reports at its exit,
the front-end with no check, the engine core with the model's. The file is one report of every process that ran beside
the others, whichever exits first: the totals (what the gate reads, its case process alone) are the processes' sums,
`processes` lists each with its checks, and a report left by an earlier run is replaced, never counted. Stand-ins:
two real processes that install the plugin's exit report as the plugin does (counters.report_at_exit)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from repro.vllm_integration.plugin import counters
from tests.commands import ROOT

# one process of a vLLM run with the auditor installed: its checks (and, with any, one stale view) reported at exit,
# which comes when the test closes its stdin
PROCESS = """
import atexit, sys
from repro.vllm_integration.plugin import counters
from repro.vllm_integration.plugin.audit import Mismatch
path, checks = sys.argv[1], int(sys.argv[2])
atexit.register(counters.report_at_exit(path))  # as plugin.register does once the auditor installed
counters.AUDITOR.checks, counters.AUDITOR.views, counters.AUDITOR.descriptor_checks = checks, 4 * checks, checks
if checks:
    counters.AUDITOR.mismatches.append(Mismatch("t4r4", "seq_lens", "seq_lens", 0, 5, 7))
print("installed", flush=True)
sys.stdin.read()
"""


def _start(path, checks: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", PROCESS, str(path), str(checks)],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout.readline().strip() == "installed"
    return p


def _exit(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.stdout.read()
    assert p.wait(timeout=60) == 0


@pytest.mark.parametrize("first", ["front-end", "engine core"])
def test_a_process_that_checked_nothing_never_hides_the_engine_cores_checks_whichever_exits_first(tmp_path, first):
    audit = tmp_path / "audit.json"
    front = _start(audit, 0)  # vLLM's front-end: the plugin loaded, the auditor installed, no model run here
    engine = _start(audit, 12)  # its engine core, started by the front-end: every check of the run
    for p in (front, engine) if first == "front-end" else (engine, front):
        _exit(p)
    doc = json.loads(audit.read_text())
    assert (doc["checks"], doc["views"], doc["descriptor_checks"], len(doc["mismatches"])) == (12, 48, 12, 1)
    by_pid = {p["pid"]: p for p in doc["processes"]}
    assert set(by_pid) == {front.pid, engine.pid}  # how many processes reported, and which
    assert (by_pid[front.pid]["checks"], by_pid[engine.pid]["checks"]) == (0, 12)  # which had checks
    assert (by_pid[front.pid]["stale"], by_pid[engine.pid]["stale"]) == (0, 1)
    assert doc["summary"].startswith("2 process(es) reported, 1 with checks: ")
    assert doc["mismatches"][0]["buffer"] == "seq_lens"  # as the gate reads them
    assert by_pid[engine.pid]["counters"]["checks"] == 12


def test_an_earlier_runs_report_is_replaced_never_counted_as_this_runs(tmp_path):
    audit = tmp_path / "audit.json"
    _exit(_start(audit, 7))  # an earlier run: done before this one's processes installed their auditor
    time.sleep(0.05)
    p = _start(audit, 0)
    _exit(p)
    doc = json.loads(audit.read_text())
    assert [x["pid"] for x in doc["processes"]] == [p.pid] and (doc["checks"], doc["mismatches"]) == (0, [])
    assert doc["summary"].startswith("1 process(es) reported, 0 with checks: ")


def test_one_process_alone_writes_what_the_gate_reads(tmp_path):
    """A gate case runs vLLM in one process (multiprocessing off): the file's totals are that process's own."""
    audit = tmp_path / "audit.json"
    p = _start(audit, 3)
    _exit(p)
    doc = json.loads(audit.read_text())
    assert (doc["checks"], doc["views"], doc["descriptor_checks"], len(doc["mismatches"])) == (3, 12, 3, 1)
    assert [x["pid"] for x in doc["processes"]] == [p.pid]


def test_the_merge_keeps_each_processs_mismatches_with_it():
    """merged_report alone: the reports written since this process installed are kept with their own mismatches (a
    process's are the slice its `stale` counts, in the order of `processes`); an older file's shape is replaced."""
    a = {"pid": 1, "process": "A", "installed": 10.0, "written": 20.0, "checks": 2, "views": 8, "descriptor_checks": 1}
    a |= {"stale": 2, "summary": "a", "counters": {}}
    b = {**a, "pid": 2, "process": "B", "installed": 5.0, "written": 3.0, "stale": 1, "summary": "b"}
    earlier = {"processes": [b, a], "mismatches": [{"m": "b1"}, {"m": "a1"}, {"m": "a2"}]}
    mine = {**a, "pid": 3, "process": "C", "installed": 15.0, "written": 30.0, "checks": 0, "stale": 1}
    doc = counters.merged_report(earlier, mine, [{"m": "c1"}])
    assert [p["pid"] for p in doc["processes"]] == [1, 3]  # B wrote before C installed: another run's
    assert doc["mismatches"] == [{"m": "a1"}, {"m": "a2"}, {"m": "c1"}] and doc["checks"] == 2
    old_shape = {"checks": 9, "mismatches": [{"m": "x"}], "summary": "s", "counters": {}}  # before `processes`
    assert counters.merged_report(old_shape, mine, [])["checks"] == 0
