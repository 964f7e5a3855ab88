"""A case process that stopped making progress is a hang before its timeout (repro.run.process.Stall): silent for
quiet_s once its marker appeared (the vLLM gate: 45 s once CUDA graph capture began), it is killed with its group and
classified a hang that says it stalled; a process that keeps printing, or never printed the marker, waits for its
timeout. On the H200 0.25.1 at sm_margin:66 spent 4.5 minutes silent in six draft prefill captures and came back
clean at 290 s of a 300 s timeout (results/h200-sweep-smmargin)."""

from __future__ import annotations

import re
import sys
import time
from dataclasses import replace

import pytest

from repro.case.spec import CAPTURING, STALLED
from repro.contract.verdicts import CLEAN, ERROR, HANG
from repro.judge import policy
from repro.judge.decision import GateOutcome
from repro.run.process import Stall, StallRule
from repro.run.runner import supervise
from repro.vllm_integration.gate import case as gate_case
from repro.vllm_integration.gate.case import CAPTURE_STALL, GateCase
from repro.vllm_integration.gate.launch import FORK, SPAWN
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.run import run_gate
from tests.processes import gone
from tests.test_vllm_gate_fork import _build, needs_entry_point


def test_a_watch_arms_at_its_marker_and_fires_after_the_quiet_time(tmp_path):
    out = tmp_path / "case.out.log"
    out.write_text("importing\n")
    w = Stall(out, StallRule("Capturing CUDA graphs", 5.0))
    assert not w.check(0.0) and not w.check(100.0)  # silent, but before the marker: only the timeout applies
    with open(out, "a") as f:
        f.write("Capturing CUDA")  # a marker split over two writes
    assert not w.check(101.0)
    with open(out, "a") as f:
        f.write(" graphs (FULL):   0%|\r")
    assert not w.check(102.0) and w.armed
    assert not w.check(106.5)  # 4.5 s quiet
    with open(out, "a") as f:
        f.write("Capturing CUDA graphs (FULL):  10%|\r")
    assert not w.check(107.5) and not w.check(112.0)  # output again: the quiet time starts over
    assert w.check(112.6)
    assert "no output for 5 s after 'Capturing CUDA graphs'" in w.why()


def test_the_gate_watches_every_case_outside_compute_sanitizer_for_a_capture_stall():
    assert CAPTURE_STALL.marker == "Capturing CUDA graphs" and CAPTURE_STALL.quiet_s == 45.0
    for mode in parse_modes("plain,audit,sm_margin:16,mps:16,poison:int-max"):
        assert GateCase(_fake_build(), mode).stall == CAPTURE_STALL, mode.name
    for mode in parse_modes("memcheck,memcheck:own,memcheck:async,memcheck:own+poison:int-max"):
        assert GateCase(_fake_build(), mode).stall is None, mode.name  # memcheck's slow kernels end by the timeout


def _fake_build():
    from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

    return VllmBuild("0.26.0", "/nonexistent", UNDER_TEST, "0.26.0")


def _script(tmp_path, body: str) -> list[str]:
    f = tmp_path / "child.py"
    f.write_text(body)
    return [sys.executable, str(f)]


def test_a_silent_process_after_its_marker_is_killed_long_before_its_timeout(tmp_path):
    cmd = _script(tmp_path, "import time\nprint('Capturing CUDA graphs', flush=True)\ntime.sleep(60)\n")
    t0 = time.time()
    run = supervise(cmd, {}, tmp_path / "out.log", 30.0, stall=Stall(tmp_path / "out.log", StallRule("Capturing", 1.0)))
    assert run.stalled and run.timed_out and run.returncode != 0 and time.time() - t0 < 10


def test_a_process_that_keeps_printing_is_not_stalled(tmp_path):
    body = "import time\nfor i in range(12):\n    print('Capturing', i, flush=True)\n    time.sleep(0.25)\n"
    run = supervise(_script(tmp_path, body), {}, tmp_path / "out.log", 30.0,
                    stall=Stall(tmp_path / "out.log", StallRule("Capturing", 1.0)))  # fmt: skip
    assert not run.stalled and not run.timed_out and run.returncode == 0


@needs_entry_point
@pytest.mark.parametrize("launcher", [FORK, SPAWN])
def test_a_gate_case_that_stalls_is_a_hang_that_says_so(tmp_path, monkeypatch, launcher):
    """A stand-in build that hangs after its captures (tests/fake_vllm.py `hang`: it prints its helper's pid, then
    sleeps): with a 2 s quiet time the case is a hang well inside its 60 s timeout, its helper killed with it."""
    monkeypatch.setattr(gate_case, "CAPTURE_STALL", replace(CAPTURE_STALL, marker="stand-in hang", quiet_s=2.0))
    build = _build(tmp_path, "hang")
    t0 = time.time()
    run = run_gate(
        [build], parse_modes("plain"), tmp_path / "logs", timeout_s=60, self_control="none", launcher=launcher
    )
    (case, res), (_, ref) = run.cases[0], run.references[0]
    assert res.verdict == HANG and ref.verdict == CLEAN
    assert "stalled: no output for 2 s after 'stand-in hang'" in res.reason and res.wall_s < 30
    assert "the stall rule, not the timeout" in res.evidence  # the evidence line says what stopped it, too
    assert time.time() - t0 < 60
    log = (tmp_path / "logs" / f"{case.case_id}.out.log").read_text()
    assert gone(int(re.search(r"stand-in hang: helper process (\d+)", log)[1]))


@pytest.mark.parametrize("marker", ["stand-in hang", "never printed"], ids=["after-the-marker", "before-the-marker"])
def test_a_hang_counts_as_evidence_only_once_the_captures_had_begun(tmp_path, monkeypatch, marker):
    """A case stopped at its timeout (no stall: the quiet time is longer) is a hang, kernel evidence, only when its
    output showed the captures begun (the CAPTURING flag); before that (vLLM's import, its engine's start, a
    compile) a hang says nothing of the captures: an error, never a control's evidence."""
    monkeypatch.setattr(gate_case, "CAPTURE_STALL", replace(CAPTURE_STALL, marker=marker, quiet_s=300.0))
    build = _build(tmp_path, "hang")
    run = run_gate([build], parse_modes("plain"), tmp_path / "logs", timeout_s=6, self_control="none", launcher=FORK)
    res = run.cases[0][1]
    if marker == "stand-in hang":
        assert res.verdict == HANG and CAPTURING in res.flags and STALLED not in res.flags
        assert policy.problem(policy.KNOWN_BAD_BUILD, res.verdict) is None  # a control's evidence
    else:
        assert res.verdict == ERROR and "before vLLM began capturing CUDA graphs" in res.reason
        assert policy.problem(policy.KNOWN_BAD_BUILD, res.verdict) is not None  # never a control's evidence
        assert run.outcome() == GateOutcome.CANNOT_VOUCH
