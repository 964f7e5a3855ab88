"""The audit file (REPRO_AUDIT_FILE, a request's audit_file) of a person's vLLM run with its multi-process engine
(VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's default): every process vLLM starts loads the plugin and reports at its exit,
the front-end with no check, the engine core with the model's. The file is one report of every process of the run (the
processes with its token, REPRO_AUDIT_RUN, which the first sets and the others inherit), whichever exits first: the
totals (what the gate reads, its case process alone) are the processes' sums, `processes` lists each with its checks,
and a report left by an earlier run is replaced, never counted. Stand-ins: real processes that install the plugin's
exit report as the plugin does (counters.at_exit, counters.report_at_exit), started one by one with the run's token,
at once, or by multiprocessing (fork, as vLLM used as a library starts its engine core, and spawn)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from repro.vllm_integration.plugin import audit_file, counters
from tests.commands import ROOT

# one process of a vLLM run with the auditor installed: its checks (and, with any, one stale view) reported at exit,
# which comes when the test closes its stdin; `slow`: its merge takes 0.05 s (a slow file system), inside the lock
PROCESS = """
import sys, time
from repro.vllm_integration.plugin import audit_file, counters
from repro.vllm_integration.plugin.audit import Mismatch
path, checks, slow = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "slow"
counters.at_exit(counters.report_at_exit(path))  # as plugin.register does once the auditor installed
counters.AUDITOR.checks, counters.AUDITOR.views, counters.AUDITOR.descriptor_checks = checks, 4 * checks, checks
if checks:
    counters.AUDITOR.mismatches.append(Mismatch("t4r4", "seq_lens", "seq_lens", 0, 5, 7))
if slow:
    merge = audit_file.merged_report
    audit_file.merged_report = lambda *a: (time.sleep(0.05), merge(*a))[1]
print("installed", flush=True)
sys.stdin.read()
"""


def _start(path, checks: int, run: str | None = None, slow: bool = False) -> subprocess.Popen:
    """One process; `run`: the token of the run it belongs to (as inherited from the run's first process), else its
    own (the variable this test's process may hold removed)."""
    env = {k: v for k, v in os.environ.items() if k != counters.RUN_ENV} | ({counters.RUN_ENV: run} if run else {})
    p = subprocess.Popen(
        [sys.executable, "-c", PROCESS, str(path), str(checks), "slow" if slow else "-"],
        cwd=ROOT,
        env=env,
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
    front = _start(audit, 0, run="1-2.5")  # vLLM's front-end: the plugin loaded, the auditor installed, no model here
    engine = _start(audit, 12, run="1-2.5")  # its engine core, started by the front-end: every check of the run
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
    _exit(_start(audit, 7))  # an earlier run: its own token
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


def test_a_process_of_the_run_that_exited_before_another_installed_is_kept(tmp_path):
    """Two LLM instances in one script, or an engine core started late: the first process reported before the second
    installed its auditor; one run's token, one report of both."""
    audit = tmp_path / "audit.json"
    first = _start(audit, 5, run="7-1.0")
    _exit(first)
    second = _start(audit, 0, run="7-1.0")
    _exit(second)
    doc = json.loads(audit.read_text())
    assert [x["pid"] for x in doc["processes"]] == [first.pid, second.pid]
    assert (doc["checks"], len(doc["mismatches"])) == (5, 1)
    assert doc["summary"].startswith("2 process(es) reported, 1 with checks: ")


def test_processes_that_report_at_once_each_keep_their_report(tmp_path):
    """Several processes of one run exit together: each merge is read, merged and written under the file's lock (a
    merge that takes 0.05 s, so without the lock they would all read the same file and keep one report)."""
    audit = tmp_path / "audit.json"
    ps = [_start(audit, n, run="9-1.0", slow=True) for n in range(1, 7)]
    for p in ps:
        p.stdin.close()
    for p in ps:
        p.stdout.read()
        assert p.wait(timeout=60) == 0
    doc = json.loads(audit.read_text())
    assert sorted(x["pid"] for x in doc["processes"]) == sorted(p.pid for p in ps)
    assert (doc["checks"], doc["views"], doc["descriptor_checks"], len(doc["mismatches"])) == (21, 84, 21, 6)
    assert doc["summary"].startswith("6 process(es) reported, 6 with checks: ")


# a front-end that starts its engine core with multiprocessing; `who` installed the exit report: the front-end before
# it started the child (the child inherits it and loads no plugin again, as vLLM forks its engine core), the child
# alone (the parent doing nothing; a spawned child always installs it: it loads the plugin anew), or the front-end,
# which checked 5 times itself before it forked a worker that does nothing (a compile pool's worker: it must not
# report its parent's checks again)
STARTS = """
import multiprocessing, sys
from repro.vllm_integration.plugin import audit_file, counters
from repro.vllm_integration.plugin.audit import Mismatch

def run_checks(n):
    a = counters.AUDITOR
    a.checks, a.views, a.descriptor_checks = a.checks + n, a.views + 4 * n, a.descriptor_checks + n
    a.mismatches.append(Mismatch("t4r4", "seq_lens", "seq_lens", 0, 5, 7))

def engine_core(path, method, who):
    if who == "child" or method == "spawn":  # a spawned child starts anew: vLLM loads the plugin in it
        counters.at_exit(counters.report_at_exit(path))
    if who != "worker":
        run_checks(12)

if __name__ == "__main__":
    path, method, who = sys.argv[1:]
    if who != "child":
        counters.at_exit(counters.report_at_exit(path))
    if who == "worker":
        run_checks(5)
    ctx = multiprocessing.get_context(method)
    child = ctx.Process(target=engine_core, args=(path, method, who), name="EngineCore_DP0")
    child.start()
    child.join()
    print("CHILD", child.pid, child.exitcode, flush=True)
"""


@pytest.mark.parametrize(
    ("method", "who"),
    [("fork", "parent"), ("fork", "child"), ("fork", "worker"), ("spawn", "parent"), ("spawn", "child")],
)
def test_a_child_multiprocessing_started_reports_its_checks(tmp_path, method, who):
    """A fork child ends through os._exit (no atexit handler runs): it reports through multiprocessing's finalizers."""
    audit, script = tmp_path / "audit.json", tmp_path / "starts.py"
    script.write_text(STARTS)
    env = {k: v for k, v in os.environ.items() if k != counters.RUN_ENV} | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(script), str(audit), method, who], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    child_pid, exitcode = next(map(int, x.split()[1:]) for x in out.stdout.splitlines() if x.startswith("CHILD "))
    assert exitcode == 0
    doc = json.loads(audit.read_text())
    by_pid = {p["pid"]: p for p in doc["processes"]}
    if who == "worker":  # the worker did nothing: only the front-end's own 5 checks, once
        assert child_pid not in by_pid and (doc["checks"], len(doc["mismatches"])) == (5, 1)
        return
    assert by_pid[child_pid]["process"] == "EngineCore_DP0" and by_pid[child_pid]["checks"] == 12
    assert (doc["checks"], doc["views"], doc["descriptor_checks"], len(doc["mismatches"])) == (12, 48, 12, 1)
    reported = "2 process(es) reported, 1 with checks" if who == "parent" else "1 process(es) reported, 1 with checks"
    assert doc["summary"].startswith(reported)


def test_the_merge_keeps_each_processs_mismatches_with_it():
    """merged_report alone: the reports of this run (its token) are kept with their own mismatches (a process's are
    the slice its `stale` counts, in the order of `processes`), whenever they were written; another run's are
    replaced, and an older file's shape too."""
    a = {"pid": 1, "process": "A", "run": "r", "installed": 10.0, "written": 3.0, "checks": 2, "views": 8}
    a |= {"descriptor_checks": 1, "stale": 2, "summary": "a", "counters": {}}
    b = {**a, "pid": 2, "process": "B", "run": "earlier", "installed": 5.0, "written": 30.0, "stale": 1, "summary": "b"}
    earlier = {"processes": [b, a], "mismatches": [{"m": "b1"}, {"m": "a1"}, {"m": "a2"}]}
    mine = {**a, "pid": 3, "process": "C", "installed": 15.0, "written": 30.0, "checks": 0, "stale": 1}
    doc = audit_file.merged_report(earlier, mine, [{"m": "c1"}])
    assert [p["pid"] for p in doc["processes"]] == [1, 3]  # A wrote before C installed, of C's run; B another run's
    assert doc["mismatches"] == [{"m": "a1"}, {"m": "a2"}, {"m": "c1"}] and doc["checks"] == 2
    old_shape = {"checks": 9, "mismatches": [{"m": "x"}], "summary": "s", "counters": {}}  # before `processes`
    assert audit_file.merged_report(old_shape, mine, [])["checks"] == 0
