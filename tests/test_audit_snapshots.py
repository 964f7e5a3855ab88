"""A process's report kept on disk while it runs (plugin.counters.keep_snapshot): `vllm serve`'s shutdown force-kills
its engine core (SIGKILL), no exit report is written, and its snapshot is what it checked. Stand-ins: real processes
that install the plugin's report as the plugin does (counters.at_exit, report_at_exit, mark_started), take a snapshot
as a FULL capture's end does, and are killed with SIGKILL in a tmp folder; `repro audit`'s judgement and exit code
read what they left (ci.command.read_back, ci.judge.judge, exit_codes.audit)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import types

import pytest

from repro import exit_codes
from repro.judge.decision import GateOutcome
from repro.vllm_integration.ci import command, report
from repro.vllm_integration.ci.judge import Expect, judge
from repro.vllm_integration.plugin import audit_file, counters
from repro.vllm_integration.plugin.audit import FreshnessAuditor, Mismatch
from tests.commands import ROOT

MGR = "SpeculatorCudaGraphManager.decode_cudagraph_manager of Speculator"
# an engine core: the auditor installed with the run's audit file and start mark; `snap` a FULL capture pass audited
# (and `stale` a stale finding in it), its snapshot taken as the capture's end takes it; then it waits to be killed
PROCESS = """
import os, sys
from repro.vllm_integration.plugin import audit_file, counters
from repro.vllm_integration.plugin.audit import Mismatch
path, folder, what, mgr = sys.argv[1:]
counters.at_exit(counters.report_at_exit(path))
counters.mark_started(folder)
if what != "none":
    a, c = counters.AUDITOR, counters.COUNTERS
    a.checks, a.views, a.descriptor_checks = 40, 160, 12
    counters._installed.update(("audit", "probe"))
    c["full_captures_by_manager"] = c["audited_by_manager"] = {mgr: 6}
    c["spec_layout_known"], c["speculative_methods"] = True, {"eagle": 6}
    if what == "stale":
        a.mismatches.append(Mismatch("FULL t8r8 q4", "seq_lens", "seq_lens", 2, 9, 7))
    counters.keep_snapshot("a FULL capture (draft decode) by " + mgr, now=True)
print("ready", flush=True)
sys.stdin.read()
"""


def _engine(tmp_path, what: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != counters.RUN_ENV} | {counters.RUN_ENV: "serve-1"}
    args = [str(tmp_path / command.AUDIT_FILE), str(tmp_path / command.STARTED), what, MGR]
    p = subprocess.Popen(
        [sys.executable, "-c", PROCESS, *args], cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert p.stdout.readline().strip() == b"ready"
    return p


def _kill(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGKILL)
    assert p.wait(timeout=30) == -signal.SIGKILL


def _judged(tmp_path):
    doc, marks, unreadable = command.read_back(tmp_path)
    assert unreadable is None
    j = judge(doc, marks, Expect(method="eagle"))
    return j, int(exit_codes.audit(j.outcome))


@pytest.mark.parametrize(("what", "outcome", "code"), [("clean", "PASS", 0), ("stale", "AFFECTED", 1)])
def test_a_process_killed_after_a_capture_pass_is_judged_from_its_snapshot(tmp_path, what, outcome, code):
    (tmp_path / command.STARTED).mkdir()
    _kill(_engine(tmp_path, what))
    j, exit_code = _judged(tmp_path)
    assert (j.outcome.value, exit_code) == (outcome, code), j.reasons
    assert j.checks == 40 and j.audited_by_manager == {MGR: 6} and j.stale_fields == (what == "stale")
    assert not any("never reported" in r for r in j.reasons)
    (row,) = j.processes
    assert row["reported"] and row["snapshot"].startswith(
        f"no exit report (killed, or still running when read); last snapshot after a FULL capture (draft decode) by {MGR}"
        + (" (a stale finding)" if what == "stale" else "")
    )
    assert "UTC; checks after " in row["snapshot"] and row["snapshot"].endswith("UTC not seen")
    said = report.lines(j, None, code)
    assert f"  pid {row['pid']} (MainProcess): {row['snapshot']}" in said
    assert "processes: 1 reported (1 by a snapshot only), 0 started and never reported" in said
    assert f"| snapshot only: {row['snapshot']} |" in report.markdown(j, None, code)


def test_a_process_killed_before_any_snapshot_stays_cannot_vouch_beside_one_judged_from_its_snapshot(tmp_path):
    (tmp_path / command.STARTED).mkdir()
    snapped, bare = _engine(tmp_path, "clean"), _engine(tmp_path, "none")
    _kill(snapped)
    _kill(bare)
    j, exit_code = _judged(tmp_path)
    assert (j.outcome, exit_code) == (GateOutcome.CANNOT_VOUCH, 4)
    assert j.reasons == [
        f"pid {bare.pid} (MainProcess) installed the auditor and never reported (killed, or died before its exit report)"
    ]
    assert [(r["pid"], r["reported"], bool(r.get("snapshot"))) for r in j.processes] == [
        (snapped.pid, True, True),
        (bare.pid, False, False),
    ]


def test_the_exit_report_replaces_the_snapshot(tmp_path):
    (tmp_path / command.STARTED).mkdir()
    p = _engine(tmp_path, "clean")
    p.stdin.close()
    assert p.wait(timeout=30) == 0
    doc, _, _ = command.read_back(tmp_path)
    (mine,) = doc["processes"]
    assert mine["final"] is True and "snapshot_reason" not in mine and mine["checks"] == 40
    j, exit_code = _judged(tmp_path)
    assert exit_code == 0 and j.snapshots == [] and j.processes[0]["snapshot"] is None


# a process that merged one report, then is killed (SIGKILL) half-way through writing its next
HALF = """
import os, pathlib, signal, sys
from repro.vllm_integration.plugin import audit_file, counters
path = sys.argv[1]
report = {"pid": 1, "process": "EngineCore", "run": "r", "installed": 1.0, "written": 2.0, "checks": 7, "views": 9,
          "descriptor_checks": 3, "stale": 0, "summary": "s", "counters": {}, "final": False, "snapshot_reason": "x"}
audit_file.merge_into(path, [(report, [])])
def half(self, data, *a, **kw):
    with open(self, "w") as f:
        f.write(data[:40])
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
pathlib.Path.write_text = half
audit_file.merge_into(path, [({**report, "checks": 8}, [])])
"""


def test_a_writer_killed_mid_write_leaves_the_last_whole_report_where_the_judge_reads(tmp_path):
    (tmp_path / command.STARTED).mkdir()
    path = tmp_path / command.AUDIT_FILE
    p = subprocess.run([sys.executable, "-c", HALF, str(path)], cwd=ROOT, capture_output=True, timeout=60)
    assert p.returncode == -signal.SIGKILL
    doc, _, unreadable = command.read_back(tmp_path)
    assert unreadable is None and doc["checks"] == 7  # the first report whole, never the half second one
    halves = [f for f in os.listdir(tmp_path) if f.startswith(f".{command.AUDIT_FILE}.")]
    assert len(halves) == 1 and halves[0] != command.AUDIT_FILE
    assert (tmp_path / halves[0]).read_text() != path.read_text()


@pytest.fixture
def fresh(monkeypatch):
    """The plugin's state for this test alone: its own counters, auditor, reports and a clock the test moves."""
    clock = types.SimpleNamespace(now=1000.0)
    monkeypatch.setattr(counters, "COUNTERS", counters.new_counters())
    monkeypatch.setattr(counters, "AUDITOR", FreshnessAuditor())
    monkeypatch.setattr(counters, "_REPORTS", [])
    monkeypatch.setattr(counters, "_SNAP", {"at": 0.0, "progress": None, "stale": 0, "base": 0})
    monkeypatch.setattr(counters, "time", types.SimpleNamespace(monotonic=lambda: clock.now, time=lambda: 5.0))
    written: list[str] = []
    cb = counters.AtExit(lambda base: written.append("exit"), lambda base, reason: written.append(reason))
    counters._REPORTS.append(cb)
    return clock, written, cb


def test_snapshots_are_rate_limited_but_the_first_stale_finding_is_written_at_once(fresh):
    clock, written, exit_report = fresh
    a = counters.AUDITOR
    a.checks = 1
    counters.keep_snapshot("a replay")  # counts moved, none written yet
    a.checks = 2
    clock.now += 1.0
    counters.keep_snapshot("a replay")  # 1 s later: rate-limited
    assert written == ["a replay"]
    clock.now += 0.5
    a.mismatches.append(Mismatch("FULL t8r8 q4", "seq_lens", "seq_lens", 2, 9, 7))
    counters.keep_snapshot("a replay")  # the process's first stale finding: at once, whatever the interval
    assert written[-1] == "a replay (a stale finding)"
    clock.now += 0.5
    a.mismatches.append(Mismatch("FULL t4r4 q4", "seq_lens", "seq_lens", 1, 9, 7))
    counters.keep_snapshot("a FULL capture")  # a later finding, a capture's end: rate-limited
    assert len(written) == 2
    clock.now += 2.0
    counters.keep_snapshot("a FULL capture")  # 2 s on, counts moved: written
    assert written[-1] == "a FULL capture"
    clock.now += 2.5
    counters.keep_snapshot("a replay")  # counts unchanged since the last snapshot: nothing to write
    assert len(written) == 3
    a.checks = 3
    counters.keep_snapshot("an eager forward's check")  # changed, 2.5 s on: written
    clock.now += 0.1
    counters.keep_snapshot("asked", now=True)  # `now`: at once
    assert written[3:] == ["an eager forward's check", "asked"]
    exit_report()
    a.checks = 4
    clock.now += 10
    counters.keep_snapshot("a FULL capture", now=True)  # after the exit report: never replaced by a snapshot
    assert written[5:] == ["exit"]


def _report(pid: int, checks: int, final: bool) -> dict:
    return {"pid": pid, "process": "EngineCore", "run": "r", "installed": 1.0, "written": 2.0, "checks": checks,
            "views": 1, "descriptor_checks": 1, "stale": 0, "summary": "s", "counters": {}, "final": final}  # fmt: skip


def test_a_snapshot_never_replaces_its_process_s_exit_report_in_the_file(tmp_path):
    """A snapshot that raced the exit report (its check before the lock) or came later: the exit report stays."""
    path = str(tmp_path / "audit.json")
    audit_file.merge_into(path, [(_report(7, 5, final=True), [])])
    audit_file.merge_into(path, [(_report(7, 3, final=False), [])])
    doc = counters.json.loads((tmp_path / "audit.json").read_text())
    assert [(p["pid"], p["checks"], p["final"]) for p in doc["processes"]] == [(7, 5, True)] and doc["checks"] == 5
    audit_file.merge_into(path, [(_report(7, 6, final=True), [])])  # an exit report replaces whatever was there
    assert counters.json.loads((tmp_path / "audit.json").read_text())["checks"] == 6


MERGER = """
import sys
from repro.vllm_integration.plugin import audit_file, counters
report = {"pid": int(sys.argv[2]), "process": "EngineCore", "run": "r", "installed": 1.0, "written": 2.0,
          "checks": 1, "views": 1, "descriptor_checks": 1, "stale": 0, "summary": "s", "counters": {}, "final": True}
for k in range(40):
    audit_file.merge_into(sys.argv[1], [({**report, "checks": k + 1}, [])])
"""


def test_the_audit_file_lock_leaves_nothing_behind_and_concurrent_writers_lose_no_report(tmp_path):
    """The lock is the audit folder's own (flock on the folder): nothing made in the temp folder or beside the
    file (a lock file a run in the temp folder was left by each run: 1,600 of them on one machine), and four
    processes merging at once keep every one's report."""
    tmp, out = tmp_path / "tmp", tmp_path / "out"
    tmp.mkdir(), out.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    path = str(out / "audit.json")
    ps = [subprocess.Popen([sys.executable, "-c", MERGER, path, str(pid)], cwd=ROOT, env=env) for pid in range(4)]
    assert [p.wait(timeout=120) for p in ps] == [0] * 4
    doc = counters.json.loads((out / "audit.json").read_text())
    assert sorted(p["pid"] for p in doc["processes"]) == [0, 1, 2, 3] and doc["checks"] == 4 * 40
    assert list(tmp.iterdir()) == [] and sorted(f.name for f in out.iterdir()) == ["audit.json"]


def test_a_folder_the_filesystem_will_not_flock_falls_back_to_a_lock_file_in_the_temp_folder(tmp_path, monkeypatch):
    """NFS may refuse a flock on a folder opened read-only (EBADF), Lustre without -o flock any flock on it: the
    merge takes a lock file in the temp folder instead, never drops the report."""
    import errno
    import fcntl
    import tempfile

    real_flock = fcntl.flock

    def nfs_flock(fd, op):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            raise OSError(errno.EBADF, "Bad file descriptor")
        return real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", nfs_flock)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    path = str(tmp_path / "audit.json")
    audit_file.merge_into(path, [(_report(7, 5, final=True), [])])
    assert counters.json.loads((tmp_path / "audit.json").read_text())["checks"] == 5
    assert [f.name.startswith("repro-audit-") for f in (tmp_path / "tmp").iterdir()] == [True]


def test_a_lock_that_cannot_be_taken_leaves_no_descriptor_open(tmp_path, monkeypatch):
    """No flock anywhere (ENOLCK): the merge fails (a snapshot missing, never a crash: keep_snapshot suppresses it),
    and the lock file's descriptor is closed: snapshots come every 2 s for the engine's whole run."""
    import errno
    import fcntl
    import tempfile

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(5):
        with pytest.raises(OSError):
            audit_file.merge_into(str(tmp_path / "audit.json"), [(_report(7, 5, final=True), [])])
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_snapshot_never_raises_into_vllm_whatever_the_file_holds(tmp_path, monkeypatch):
    path = tmp_path / "audit.json"
    path.write_text('{"processes": [{"pid": 1, "run": "r", "stale": null}], "mismatches": []}')
    counters.write_snapshot(str(path), 1.0, "r", None, "a replay")  # a malformed entry: counts no mismatches
    assert any(p.get("final") is False for p in counters.json.loads(path.read_text())["processes"])
    monkeypatch.setattr(counters, "own_report", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    counters.write_snapshot(str(path), 1.0, "r", None, "a replay")  # swallowed: a snapshot missing, never a crash


def test_a_fork_child_s_first_stale_finding_is_written_at_once_after_its_parent_s(fresh):
    clock, written, cb = fresh
    counters.AUDITOR.mismatches.append(Mismatch("FULL t8r8 q4", "seq_lens", "seq_lens", 2, 9, 7))
    counters.keep_snapshot("parent")
    assert written == ["parent (a stale finding)"]
    cb.forked()  # the child: what its parent found is not its own
    counters.keep_snapshot("child, nothing new")
    assert written == ["parent (a stale finding)"]  # rate-limited: nothing of its own found
    counters.AUDITOR.mismatches.append(Mismatch("FULL t4r4 q4", "seq_lens", "seq_lens", 1, 9, 7))
    counters.keep_snapshot("child")
    assert written[-1] == "child (a stale finding)"


def test_keeping_a_snapshot_never_raises_into_vllm_s_hot_paths(fresh, monkeypatch):
    clock, written, _ = fresh
    counters.AUDITOR.checks = 1
    monkeypatch.setattr(counters, "_progress", lambda: {}["a counter a stand-in lacks"])
    counters.keep_snapshot("an eager forward's check")  # called from vLLM's forward: a snapshot missing, no raise
    assert written == []
