"""`gate` ended by a cancelled CI job (SIGTERM) or a closed terminal (SIGHUP) as by Ctrl-C: its case processes
stopped, its report folder marked INTERRUPTED with no results.json, exit 130; before, SIGTERM killed it at once and
left a folder of logs without the mark. A SIGHUP the caller ignores (nohup) stays ignored: the run goes on to its
answer. Stand-in builds (tests/fake_vllm.py) through the real launcher, no GPU."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from tests.commands import ROOT, isolated_env
from tests.fake_vllm import write_fake_vllm


def _gate(tmp_path, ignore_hup: bool = False) -> subprocess.Popen:
    prefix = write_fake_vllm(tmp_path / "good", "0.34.0", "good")
    env = {**isolated_env(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "repro", "gate", "--no-installed", "--vllm", f"g={prefix}", "--methods", "eagle",
           "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--jobs", "1"]  # fmt: skip
    pre = (lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)) if ignore_hup else None
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=pre)  # fmt: skip


def _first_case(p: subprocess.Popen) -> None:
    for line in p.stdout:
        if line.startswith("[gate] stale_metadata-"):  # a case has finished: the run is at work
            return
    raise AssertionError("the gate ended before any case")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_or_a_hang_up_ends_the_gate_as_ctrl_c_does(tmp_path, sig):
    p = _gate(tmp_path)
    _first_case(p)
    p.send_signal(sig)
    assert p.wait(timeout=120) == 130
    out = tmp_path / "out"
    assert (out / "INTERRUPTED").exists() and not (out / "results.json").exists()
    assert f"{signal.Signals(sig).name} (taken as Ctrl-C)" in (out / "INTERRUPTED").read_text()
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path) in _cmdline(pid)]


def test_a_hang_up_ignored_by_the_caller_nohup_lets_the_gate_answer(tmp_path):
    p = _gate(tmp_path, ignore_hup=True)
    _first_case(p)
    p.send_signal(signal.SIGHUP)
    assert p.wait(timeout=300) == 0  # PASS: the stand-in build clean, its self control caught
    assert (tmp_path / "out" / "results.json").exists() and not (tmp_path / "out" / "INTERRUPTED").exists()


def _cmdline(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


@pytest.mark.parametrize("signals", [1, 2], ids=["once", "twice"])
def test_ctrl_c_stops_the_case_processes_in_flight_at_once_not_after_them(tmp_path, signals):
    """A case that hangs (its captures never finish) must not hold Ctrl-C (here SIGTERM, its mapping) until its
    timeout: the case processes are stopped first, then the run ends, marked INTERRUPTED. A second signal (a closed
    terminal's second hang-up, Ctrl-C pressed twice) does not cut the stop short."""
    import time

    prefix = write_fake_vllm(tmp_path / "hang", "0.34.0", "hang")
    env = {**isolated_env(tmp_path), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "repro", "gate", "--no-installed", "--vllm", f"h={prefix}", "--methods", "eagle",
           "--out", str(tmp_path / "out"), "--cache-dir", str(tmp_path / "cache"), "--jobs", "1",
           "--self-control", "none", "--timeout", "200"]  # fmt: skip
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         start_new_session=True)  # fmt: skip
    logs = tmp_path / "out" / "logs"
    deadline = time.time() + 120
    while time.time() < deadline and not any("stand-in hang" in f.read_text(errors="replace")
                                              for f in logs.glob("*.out.log")):  # fmt: skip
        assert p.poll() is None, p.stdout.read()
        time.sleep(0.2)
    assert time.time() < deadline, "no case reached its hang"
    t0 = time.time()
    for _ in range(signals):
        p.send_signal(signal.SIGTERM)
        time.sleep(0.3)
    assert p.wait(timeout=120) == 130
    assert time.time() - t0 < 12  # the hanging case stopped at once (its own timeout: 200 s)
    assert (tmp_path / "out" / "INTERRUPTED").exists()
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(tmp_path) in _cmdline(pid)]


def test_once_ended_by_ctrl_c_a_further_sigterm_or_hang_up_cannot_kill_the_command_before_it_marks_its_folder():
    """CI saw it: a second SIGTERM landed after the stop, under the default handler restored on the way out, and
    killed the gate (-15) before its folder was marked. The mapping leaves both ignored once its body ended by
    Ctrl-C; a body that ended otherwise gets the caller's handlers back."""
    code = """
import signal
from repro.vllm_integration.ci.command import ended_as_ctrl_c
try:
    with ended_as_ctrl_c():
        raise KeyboardInterrupt("SIGTERM")
except KeyboardInterrupt:
    pass
print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN, signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)
with ended_as_ctrl_c():
    pass
print(signal.getsignal(signal.SIGTERM) is signal.SIG_IGN)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.stdout.split() == ["True", "True", "True"], r.stderr
    fresh = subprocess.run([sys.executable, "-c", code.split("try:")[0] + "with ended_as_ctrl_c():\n    pass\n"
                            "print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)"],
                           capture_output=True, text=True, timeout=60, cwd=ROOT)  # fmt: skip
    assert fresh.stdout.split() == ["True"], fresh.stderr
