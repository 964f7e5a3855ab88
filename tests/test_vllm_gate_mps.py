"""Under MPS (gate.run.run_gate): the cases expected clean (builds under test, references) share one daemon several at
a time; every control, expected to fault, runs alone (no other client of the daemon), since a client's fatal fault can take the
server's other clients down; a shared case that came back other than clean runs again alone and that result is kept.
Stand-in case processes and daemons: who shares a daemon with whom, what is kept, what the report says."""

from __future__ import annotations

import threading
import time

from repro.case.spec import CaseResult
from repro.contract.verdicts import CLEAN, CRASH, ERROR
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.report import markdown, to_json
from repro.vllm_integration.plugin.inject import STALE_CAPTURE
from repro.vllm_integration.releases.builds import CONTROL, UNDER_TEST, VllmBuild
from tests.recorded_gate import StandInMps

OVERLAP = 0.3  # seconds a stand-in client expected clean waits for another one to join its daemon


class _Daemon(StandInMps):
    """A stand-in MPS daemon that counts its clients while they run."""

    made: list[_Daemon] = []

    def __init__(self):
        self.clients, self.worst, self.arrivals, self.lock = 0, 0, 0, threading.Condition()
        _Daemon.made.append(self)


def _gate(monkeypatch, tmp_path, answer, modes="mps:16,mps:24", jobs=4):
    """run_gate over 0.26.0 (under test, with its self control) and 0.25.1 (control); answer(case, alone) gives each
    process's verdict, alone: no other client on its daemon when it started or ended."""
    _Daemon.made = []
    seen, lock = [], threading.Lock()

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        # alone: no other client when it came, and none came while it stayed (it stays until one does, or OVERLAP s:
        # a batch's clients meet however slowly a loaded machine starts their threads)
        with mps.lock:
            mps.clients += 1
            mps.arrivals += 1
            mine, others = mps.arrivals, mps.clients > 1
            mps.worst = max(mps.worst, mps.clients)
            mps.lock.notify_all()
            # a control is meant to run alone: no wait (another client there while it runs is what would be caught)
            mps.lock.wait_for(lambda: mps.arrivals > mine, timeout=0.03 if case.is_control else OVERLAP)
            alone = not others and mps.arrivals == mine
            mps.clients -= 1
        with lock:
            seen.append((case, mps, alone))
        return CaseResult(case.case_id, answer(case, alone), "stand-in"), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    monkeypatch.setattr(gate_run, "MpsDaemon", _Daemon)
    # the processes' verdicts as they are: the reference comparison is not what these tests are about
    monkeypatch.setattr(gate_run, "validate", lambda c, r, out: r)
    monkeypatch.setattr(gate_run, "finish", lambda c, r, out, ref, ref_out: r)
    builds = [
        VllmBuild("0.26.0", str(tmp_path / "a"), UNDER_TEST, "0.26.0"),
        VllmBuild("0.25.1", str(tmp_path / "b"), CONTROL, "0.25.1"),
    ]
    # the first self-control form alone: these tests count cases by how they are scheduled, not by form
    run = gate_run.run_gate(builds, parse_modes(modes), tmp_path / "logs", jobs=jobs, self_control="under-test",
                            self_control_forms=(STALE_CAPTURE,))  # fmt: skip
    return run, seen


def test_controls_run_alone_and_the_clean_expected_share_one_daemon(monkeypatch, tmp_path):
    run, seen = _gate(monkeypatch, tmp_path, lambda c, alone: CRASH if c.is_control and not c.reference else CLEAN)
    controls = [(c, alone) for c, _, alone in seen if c.is_control and not c.reference]
    assert len(controls) == 4 and all(alone for _, alone in controls)  # 0.25.1 and the self control, 2 modes
    shared = {id(d) for c, d, _ in seen if c.reference or not c.is_control}
    assert len(shared) == 1  # 2 cases of 0.26.0 and 4 references, one daemon
    (daemon,) = [d for d in _Daemon.made if id(d) in shared]
    assert daemon.worst > 1  # they did run beside each other
    assert run.mps_reruns == [] and len(run.cases) == 6 and len(run.references) == 4
    assert run.outcome().name == "PASS"
    # the builds under test and the references first (quick, concurrent), then each control alone: a run that its
    # --deadline cuts still has the answers for the builds under test (results/h200-sweep-mps-b had none)
    order = [c.is_control and not c.reference for c, _, _ in seen]
    assert order == sorted(order) and order.count(True) == 4


def test_a_shared_case_not_clean_runs_again_alone_and_the_alone_result_is_kept(monkeypatch, tmp_path):
    def answer(c, alone):
        if c.is_control and not c.reference:
            return CRASH
        if "under-test-mps16" in c.case_id:
            return CLEAN if alone else ERROR  # a neighbour's fault took it down; alone it decodes
        return CLEAN

    run, seen = _gate(monkeypatch, tmp_path, answer)
    ran = [(c.case_id, alone) for c, _, alone in seen if "under-test-mps16" in c.case_id]
    assert ran == [(ran[0][0], False), (ran[0][0], True)]
    assert run.mps_reruns == [{"case": ran[0][0], "attempt before": "batch"}]
    kept = {c.case_id: r for c, r in run.cases}
    assert kept[ran[0][0]].verdict == CLEAN and run.outcome().name == "PASS"
    doc = to_json(run, {})
    assert doc["mps_reruns"] == run.mps_reruns
    assert f"{ran[0][0]} (after batch)" in markdown(run, {})


def test_a_build_under_test_that_faults_alone_too_is_affected(monkeypatch, tmp_path):
    run, seen = _gate(monkeypatch, tmp_path, lambda c, alone: CLEAN if c.reference else CRASH)
    last = {c.case_id: alone for c, _, alone in seen}  # each case's last process
    assert all(last[c.case_id] for c, _ in run.cases)
    again = sorted(r["case"] for r in run.mps_reruns)
    assert again == sorted(c.case_id for c, _ in run.cases if "under-test" in c.case_id)
    assert run.outcome().name == "AFFECTED"


def test_with_one_job_nothing_shares_a_daemon(monkeypatch, tmp_path):
    run, _ = _gate(monkeypatch, tmp_path, lambda c, alone: CRASH if c.is_control and not c.reference else CLEAN, jobs=1)
    assert max(d.worst for d in _Daemon.made) == 1 and run.outcome().name == "PASS"


def test_a_kept_reference_leaves_its_record_in_the_runs_logs(tmp_path):
    """A reference taken from the cache writes what its process would have left (a line, its RESULT record), so a
    replay of the run's record judges its cases from the record alone."""
    from repro.vllm_integration.gate.case import GateCase
    from repro.vllm_integration.gate.modes import GateMode

    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    ref = GateCase(build, GateMode.parse("plain"), reference=True)
    kept = {"result": {"tokens": [[1, 2, 3]], "reference": True}, "stored": "2026-12-01T20:32:43+0000"}
    gate_run.keep_in_logs(tmp_path / "logs", ref, kept)
    gate_run.keep_in_logs(tmp_path / "logs", ref, kept)  # again into the same folder: one record, not two
    assert gate_run.result_line(tmp_path / "logs", ref) == kept["result"]
    out = (tmp_path / "logs" / f"{ref.case_id}.out.log").read_text()
    assert "reference kept: the run of 2026-12-01T20:32:43+0000" in out
    assert (tmp_path / "logs" / f"{ref.case_id}.channel.jsonl").read_text().count("REPRO_RESULT") == 1


def _deadline_gate(monkeypatch, tmp_path, modes, answer, deadline_s, self_control="none", builds=None):
    """run_gate with every case process replaced below gate.process.run_case (so the deadline applies as it does on
    a GPU): answer(case) -> (verdict, seconds it runs at most, stale fields)."""
    from repro.vllm_integration.gate.case import GateCase

    seen = []

    def process(case, cmd, env, log_dir, sanitizer, executor=None, target=None):
        verdict, secs, stale = answer(case)
        seen.append((case.case_id, time.time(), case.timeout_s))
        time.sleep(min(secs, case.timeout_s))
        if secs > case.timeout_s:  # killed at its timeout, as the supervisor reports it
            verdict = HANG_
        res = CaseResult(case.case_id, verdict, f"stand-in {verdict}", wall_s=min(secs, case.timeout_s))
        res.stale_fields = stale
        return res, ""

    monkeypatch.setattr(gate_process, "run_process", process)
    monkeypatch.setattr(gate_process, "annotate", lambda res, case, ch, audit: res)
    monkeypatch.setattr(gate_run, "validate", lambda c, r, out: r)
    monkeypatch.setattr(gate_run, "finish", lambda c, r, out, ref, ref_out: r)
    builds = builds or [VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")]
    t0 = time.time()
    run = gate_run.run_gate(builds, parse_modes(modes), tmp_path / "logs", jobs=4, timeout_s=5.0,
                            self_control=self_control, deadline_s=deadline_s, launcher="spawn",
                            self_control_forms=(STALE_CAPTURE,))  # fmt: skip
    assert isinstance(run.cases[0][0], GateCase)
    return run, [(cid, at - t0, to) for cid, at, to in seen], time.time() - t0


HANG_ = "hang"


def test_the_deadline_stops_the_run_and_its_cases_are_skips_that_say_so(monkeypatch, tmp_path):
    """--deadline: a case running at it is stopped there (its timeout cut to what is left: a skip, not a hang); the
    run cannot vouch for the build; every process, a self control's further attempts too, stops by the deadline."""
    from repro.contract.verdicts import SKIP

    # every case decodes for 3 s; the self control in plain decodes cleanly, so it gets further attempts
    run, seen, wall = _deadline_gate(monkeypatch, tmp_path, "audit,plain", lambda c: (CLEAN, 3.0, {}), 1.0,
                                     self_control="under-test")  # fmt: skip
    assert wall < 2.5 and all(at < 1.0 and at + to <= 1.05 for _, at, to in seen)
    assert not any("attempt" in cid for cid, _, _ in seen)  # no further attempt started after the deadline
    results = {c.case_id: r for c, r in run.cases + run.references}
    assert all(r.verdict == SKIP for r in results.values())
    stopped = [r for r in results.values() if "stopped at the run's --deadline" in r.reason]
    waiting = [r for r in results.values() if "not started: the run's --deadline had passed" in r.reason]
    assert len(stopped) == 4 and len(waiting) == 1  # 4 jobs: the fifth process found the deadline passed
    assert run.outcome().name == "CANNOT_VOUCH"


def test_a_case_the_deadline_stopped_after_the_auditor_caught_stale_views_keeps_them(monkeypatch, tmp_path):
    from repro.contract.verdicts import STALE_AUDIT

    builds = [VllmBuild("0.26.0", str(tmp_path / "a"), UNDER_TEST, "0.26.0"),
              VllmBuild("0.25.1", str(tmp_path / "b"), CONTROL, "0.25.1")]  # fmt: skip

    def answer(c):
        slow = c.is_control and not c.reference
        return (CLEAN, 3.0 if slow else 0.1, {"query_start_loc": 96} if slow else {})

    run, seen, wall = _deadline_gate(monkeypatch, tmp_path, "audit", answer, 1.0, builds=builds)
    ctl = {c.case_id: r for c, r in run.cases if c.is_control}
    (r,) = ctl.values()
    assert r.verdict == STALE_AUDIT and "stopped at the run's --deadline" in r.reason
    assert run.outcome().name == "PASS"  # 0.26.0 clean, the control's stale views its mode's evidence


def test_a_process_the_deadline_leaves_no_room_for_is_not_started(monkeypatch, tmp_path):
    from repro.contract.verdicts import SKIP

    run, seen, wall = _deadline_gate(monkeypatch, tmp_path, "audit,plain", lambda c: (CLEAN, 0.1, {}), 0.0)
    assert seen == [] and all(r.verdict == SKIP and "not started" in r.reason for _, r in run.cases)


def test_a_gate_without_mps_modes_starts_no_mps_daemon(monkeypatch, tmp_path):
    started = []

    class Counting(StandInMps):
        def start(self):
            started.append(self)
            return self

    monkeypatch.setattr(
        gate_process, "run_attributed", lambda case, *a, **k: (CaseResult(case.case_id, CLEAN, ""), None)
    )
    monkeypatch.setattr(gate_run, "MpsDaemon", Counting)
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    gate_run.run_gate([build], parse_modes("plain"), tmp_path / "logs", jobs=2, self_control="none")
    assert started == []


def test_an_error_under_mps_fails_the_run_instead_of_dropping_its_modes(monkeypatch, tmp_path):
    """A control daemon that stops answering (its command times out) raises out of run_gate: a run judged without
    its MPS modes would pass on the rest."""
    import subprocess

    import pytest

    class Wedged(StandInMps):
        def wait_ready(self):
            raise subprocess.TimeoutExpired("nvidia-cuda-mps-control", 10)

    monkeypatch.setattr(
        gate_process, "run_attributed", lambda case, *a, **k: (CaseResult(case.case_id, CLEAN, ""), None)
    )
    monkeypatch.setattr(gate_run, "MpsDaemon", Wedged)
    builds = [VllmBuild("0.26.0", str(tmp_path / "a"), UNDER_TEST, "0.26.0"),
              VllmBuild("0.25.1", str(tmp_path / "b"), CONTROL, "0.25.1")]  # fmt: skip
    with pytest.raises(subprocess.TimeoutExpired):
        gate_run.run_gate(builds, parse_modes("plain,mps:16"), tmp_path / "logs", jobs=2, self_control="none")
