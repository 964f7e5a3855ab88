"""How MPS cases share daemons (repro.run.mps_cases), with a stand-in daemon and stand-in cases: never two daemons at
once, positive controls alone, expected-clean cases as concurrent clients, and a batch with a fault rerun case by
case under a daemon of its own."""

from __future__ import annotations

import os
import threading
import time

import pytest

from repro.case.spec import RERUN_ALONE, CaseResult, CaseSpec, SmConfig
from repro.contract.verdicts import CLEAN, CRASH, ERROR, SKIP
from repro.errors import Unavailable
from repro.run.mps_cases import PER_CASE, SHARED, run_mps_cases


class Daemons:
    """Stand-in MPS daemons that record starts and stops and fail the test if two ever run at once."""

    def __init__(self, fail_start: bool = False) -> None:
        self.started = 0
        self.running = 0
        self.fail_start = fail_start
        self.lock = threading.Lock()
        self.readiness_checks = 0
        self.recovering: list[tuple[float, list[str]]] = []  # what wait_ready answers, in turn (then: ready)

    def __call__(self):
        outer = self

        class Daemon:
            def start(self):
                if outer.fail_start:
                    raise Unavailable("nvidia-cuda-mps-control not found")
                with outer.lock:
                    assert outer.running == 0, "two MPS daemons at once"
                    outer.running += 1
                    outer.started += 1
                    self.n = outer.started
                return self

            def stop(self):
                with outer.lock:
                    outer.running -= 1

            def wait_ready(self):
                outer.readiness_checks += 1
                return outer.recovering.pop(0) if outer.recovering else (0.0, [])

            def __enter__(self):
                return self.start()

            def __exit__(self, *exc):
                self.stop()

        return Daemon()


def _spec(strategy: str, k: int) -> CaseSpec:
    return CaseSpec("upstream", strategy, sm=SmConfig.parse("mps:16"), seed=k)


class Cases:
    """Stand-in case runs: `outcome(spec, daemon_number, clients_now)` decides the verdict."""

    def __init__(self, outcome) -> None:
        self.outcome = outcome
        self.clients = 0
        self.most_clients = 0
        self.ran: list[tuple[int, int]] = []  # (seed, daemon number)
        self.lock = threading.Lock()

    def __call__(self, spec: CaseSpec, daemon) -> CaseResult:
        with self.lock:
            self.clients += 1
            self.most_clients = max(self.most_clients, self.clients)
            now = self.clients
        time.sleep(0.05)
        verdict = self.outcome(spec, daemon.n, now)
        with self.lock:
            self.clients -= 1
            self.ran.append((spec.seed, daemon.n))
        r = CaseResult(spec.case_id, verdict, f"stand-in {verdict}")
        return r


def _expected_clean(s: CaseSpec) -> bool:
    return s.strategy == "fresh"


def test_per_case_starts_a_daemon_for_every_case():
    daemons, cases = Daemons(), Cases(lambda s, d, n: CLEAN)
    specs = [_spec("fresh", k) for k in range(3)]
    out = list(run_mps_cases(specs, cases, PER_CASE, jobs=4, daemon_factory=daemons))
    assert [r.verdict for _, r in out] == [CLEAN] * 3 and daemons.started == 3 and cases.most_clients == 1


def test_shared_daemon_positive_controls_alone_clean_cases_together():
    daemons = Daemons()
    cases = Cases(lambda s, d, n: CRASH if s.strategy == "stale" else CLEAN)
    specs = [_spec("stale", 0), _spec("stale", 1)] + [_spec("fresh", k) for k in range(2, 8)]
    out = dict((s.seed, r) for s, r in run_mps_cases(specs, cases, SHARED, 3, _expected_clean, daemons))
    assert daemons.started == 1 and daemons.running == 0
    assert out[0].verdict == out[1].verdict == CRASH
    assert all(out[k].verdict == CLEAN for k in range(2, 8))
    assert cases.most_clients == 3  # the clean cases ran 3 at a time
    assert [seed for seed, _ in cases.ran[:2]] == [0, 1]  # positive controls first, one at a time


def test_the_shared_batches_may_come_before_the_cases_alone():
    daemons = Daemons()
    cases = Cases(lambda s, d, n: CRASH if s.strategy == "stale" else CLEAN)
    specs = [_spec("stale", 0), _spec("stale", 1)] + [_spec("fresh", k) for k in range(2, 5)]
    out = list(run_mps_cases(specs, cases, SHARED, 3, _expected_clean, daemons, alone_first=False))
    assert [s.seed for s, _ in out][-2:] == [0, 1] and [seed for seed, _ in cases.ran[-2:]] == [0, 1]
    assert daemons.started == 1 and {r.verdict for s, r in out if s.seed < 2} == {CRASH}
    assert cases.most_clients == 3  # the clean cases still ran together


def test_a_batch_with_a_fault_reruns_its_faulted_cases_alone():
    """A clean case that faults only because another client of its batch did: alone, it is clean again."""
    daemons = Daemons()

    def outcome(s, daemon, clients_now):
        if s.seed == 3:
            return CRASH  # a real fault: it faults alone too
        return CRASH if daemon == 1 and s.seed in (2, 4) else CLEAN  # taken down with it in the shared batch

    cases = Cases(outcome)
    specs = [_spec("fresh", k) for k in range(2, 6)]
    out = dict((s.seed, r) for s, r in run_mps_cases(specs, cases, SHARED, 4, _expected_clean, daemons))
    assert {k: r.verdict for k, r in out.items()} == {2: CLEAN, 3: CRASH, 4: CLEAN, 5: CLEAN}
    assert "rerun alone: crash in a batch of 4 MPS clients" in out[2].reason
    assert "rerun alone" in out[3].reason and "rerun alone" not in out[5].reason
    assert daemons.started == 4  # the shared one, then one for each of the three reruns
    # the flag the reports count reruns by (repro.report.benchmark), never the reason's words
    assert {k for k, r in out.items() if RERUN_ALONE in r.flags} == {2, 3, 4}


def test_an_error_under_the_shared_daemon_reruns_alone():
    daemons = Daemons()
    cases = Cases(lambda s, d, n: ERROR if d == 1 else CRASH)
    out = list(run_mps_cases([_spec("stale", 0)], cases, SHARED, 4, _expected_clean, daemons))
    assert out[0][1].verdict == CRASH and "rerun alone: ended in an error" in out[0][1].reason


def test_no_daemon_every_case_skips_with_the_reason():
    for policy in (PER_CASE, SHARED):
        cases = Cases(lambda s, d, n: CLEAN)
        out = list(
            run_mps_cases([_spec("stale", 0), _spec("fresh", 1)], cases, policy, 2, _expected_clean, Daemons(True))
        )
        assert [r.verdict for _, r in out] == [SKIP, SKIP] and "mps-control not found" in out[0][1].reason
        assert cases.ran == []


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="per-case, shared"):
        list(run_mps_cases([_spec("fresh", 0)], Cases(lambda s, d, n: CLEAN), "pooled"))


def test_memcheck_findings_in_a_batch_are_kept_other_faults_rerun():
    """An oob verdict is memcheck's finding in that client's own kernels: kept. A fault code without a finding in the
    same batch may be a neighbour's: rerun alone."""
    daemons = Daemons()
    cases = Cases(lambda s, d, n: {0: "oob", 1: CRASH}.get(s.seed, CLEAN) if d == 1 else "oob")
    specs = [_spec("stale", k) for k in range(3)]
    out = dict((s.seed, r) for s, r in run_mps_cases(specs, cases, SHARED, 3, lambda s: True, daemons))
    assert {k: r.verdict for k, r in out.items()} == {0: "oob", 1: "oob", 2: CLEAN}
    assert "rerun alone" in out[1].reason and "rerun alone" not in out[0].reason


def test_ctrl_c_stops_the_shared_daemon():
    daemons = Daemons()

    def interrupted(spec, daemon):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        list(run_mps_cases([_spec("stale", 0)], interrupted, SHARED, 2, _expected_clean, daemons))
    assert daemons.started == 1 and daemons.running == 0  # no MPS daemon left behind


def test_a_batch_attempts_logs_are_set_aside_for_the_rerun(tmp_path):
    from repro.run.runner import case_logs, set_aside_logs

    out, memcheck = case_logs(tmp_path, "c1")
    out.write_text("batch attempt")
    set_aside_logs(tmp_path, "c1", "batch")  # no memcheck log: only the output moves
    assert not out.exists() and (tmp_path / "c1.batch.out.log").read_text() == "batch attempt"
    assert not (tmp_path / "c1.batch.memcheck.log").exists() and memcheck.name == "c1.memcheck.log"


def test_a_case_the_recovering_server_refused_runs_again_under_the_same_daemon(fixtures):
    """The refusal is classified from a recorded H200 output (a client the MPS server turned away while it
    recovered); the case then runs again under the shared daemon, not under a daemon of its own."""
    from repro.judge.classify import classify, refused

    recorded = (fixtures / "outputs" / "mps-neighbour-busy-memcheck.out.log").read_text()
    daemons, attempts, set_aside = Daemons(), [], []

    def run_one(spec, daemon):
        attempts.append(daemon.n)
        if len(attempts) <= 2:
            return classify(spec, recorded, 1, False, None, 1.0)  # the server still recovering
        return CaseResult(spec.case_id, CRASH, "stand-in crash")

    out = list(
        run_mps_cases(
            [_spec("stale", 0)],
            run_one,
            SHARED,
            2,
            _expected_clean,
            daemons,
            before_rerun=lambda s, attempt: set_aside.append(attempt),
            refused_waits=(0.01, 0.01, 0.01),
        )
    )
    r = out[0][1]
    assert refused(classify(_spec("stale", 0), recorded, 1, False, None, 1.0))
    assert r.verdict == CRASH and "after 2 refusal(s)" in r.reason
    assert attempts == [1, 1, 1] and daemons.started == 1  # the same daemon every time
    assert set_aside == ["refused1", "refused2"]


def test_a_case_refused_every_time_reruns_under_a_daemon_of_its_own(fixtures):
    from repro.judge.classify import classify

    recorded = (fixtures / "outputs" / "mps-neighbour-busy-memcheck.out.log").read_text()
    daemons = Daemons()

    def run_one(spec, daemon):
        return classify(spec, recorded, 1, False, None, 1.0) if daemon.n == 1 else CaseResult(spec.case_id, CLEAN, "")

    out = list(run_mps_cases([_spec("stale", 0)], run_one, SHARED, 2, _expected_clean, daemons, refused_waits=(0.01,)))
    assert out[0][1].verdict == CLEAN and daemons.started == 2 and "rerun alone: ended in an error" in out[0][1].reason


def test_each_case_alone_waits_for_a_recovering_server_first():
    daemons = Daemons()
    daemons.recovering = [(0.0, []), (1.2, ["4242: FAULT"])]
    cases = Cases(lambda s, d, n: CRASH if s.strategy == "stale" else CLEAN)
    specs = [_spec("stale", 0), _spec("stale", 1), _spec("fresh", 2), _spec("fresh", 3)]
    out = dict((s.seed, r) for s, r in run_mps_cases(specs, cases, SHARED, 4, _expected_clean, daemons))
    assert daemons.readiness_checks == 3  # before each case alone, and before the batch
    assert "started after 1.2 s waiting for the MPS server: 4242: FAULT" in out[1].reason
    assert "waiting" not in out[0].reason and "waiting" not in out[2].reason


def test_the_daemon_reports_a_server_in_fault_until_it_recovers(tmp_path, monkeypatch):
    """MpsDaemon.wait_ready against a stand-in control program: FAULT twice, then ACTIVE."""
    import sys

    from repro.run.smcontrol import MpsDaemon

    state = tmp_path / "asked"
    control = tmp_path / "nvidia-cuda-mps-control"
    control.write_text(
        f"""#!{sys.executable}
import sys
line = sys.stdin.read().strip()
if line == "get_server_list":
    print(4242)
elif line == "get_server_status 4242":
    with open({str(state)!r}, "a") as f:
        f.write("x")
    print("FAULT" if len(open({str(state)!r}).read()) <= 2 else "ACTIVE")
"""
    )
    control.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    daemon = MpsDaemon()
    daemon.running = True  # as if started: only its commands are exercised
    waited, seen = daemon.wait_ready(timeout_s=10, poll_s=0.01)
    assert seen == ["4242: FAULT"] and 0 < waited < 10 and len(state.read_text()) == 3
    waited, seen = daemon.wait_ready(timeout_s=10)
    assert seen == [] and waited < 2  # ACTIVE: no wait beyond asking
    daemon.running = False
