"""The repro server that outlives commands (repro.run.server), with stand-in case workers: cases forked with their own
environment and session, exit codes, timeouts and a command that goes away kill the case and what it started, idle
stop, the fingerprint that keeps a server of other code from being used, and the CLI around it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from repro.case.spec import CaseSpec
from repro.contract.verdicts import CLEAN, CRASH, ERROR, HANG
from repro.run import forkserver, kept, server
from repro.run.process import case_env
from repro.run.runner import run_process
from tests.commands import ROOT, isolated_env, no_traceback
from tests.processes import gone

STANDIN = ("tests.standin_worker",)
TARGETS = frozenset(f"tests.standin_worker:{f}" for f in ("clean", "hang", "crash", "boom"))


@pytest.fixture
def sock(tmp_path, monkeypatch):
    path = tmp_path / "s" / "server.sock"
    path.parent.mkdir()  # `serve` makes no folder for a socket REPRO_SERVER names (docs/outputs.md)
    monkeypatch.setenv(server.SOCKET_ENV, str(path))
    return path


@pytest.fixture
def running(sock):
    facts = server.start(sock, idle_s=60, preload=STANDIN)
    ex = server.ServerExecutor(sock, facts, targets=TARGETS)
    yield ex
    ex.close()
    server.stop(sock)


def test_cases_forked_with_their_environment_and_exit_codes(running, tmp_path):
    out = tmp_path / "c.out.log"
    run = running.run("tests.standin_worker:clean", ["x"], {**case_env(), "STANDIN_ENV": "mine"}, out, 60)
    text = out.read_text()
    assert run.returncode == 0 and not run.timed_out and "stand-in x" in text and "env mine" in text
    assert f"pid {running.facts['pid']}" not in text  # a process of its own, not the server
    assert running.run("tests.standin_worker:crash", ["y"], case_env(), out, 60).returncode == 1


def test_verdicts_through_the_runner(running, tmp_path):
    spec = CaseSpec("vllm", "stale", timeout_s=3)
    verdicts = {}
    for fn in ("clean", "crash", "boom", "hang"):
        argv = [str(tmp_path / "pid")] if fn == "hang" else ["y"]
        res, _ = run_process(spec, [], case_env(), tmp_path, False, running, (f"tests.standin_worker:{fn}", argv))
        verdicts[fn] = res.verdict
    assert verdicts == {"clean": CLEAN, "crash": CRASH, "boom": ERROR, "hang": HANG}
    assert gone(int((tmp_path / "pid").read_text()))  # the hung case's grandchild went with it


def test_a_command_that_goes_away_takes_its_case_with_it(sock, tmp_path):
    facts = server.start(sock, idle_s=60, preload=STANDIN)
    pidfile = tmp_path / "grandchild.pid"
    try:
        with kept.try_connect(sock) as s:
            lines = s.makefile("rb")
            assert forkserver.decode(lines.readline())["kind"] == forkserver.READY
            run = {"target": "tests.standin_worker:hang", "argv": [str(pidfile)], "env": case_env()}
            s.sendall(forkserver.encode(forkserver.RUN, id=0, out=str(tmp_path / "h.log"), **run))
            pid = forkserver.decode(lines.readline())["pid"]
            for _ in range(100):
                if pidfile.exists() and pidfile.read_text():
                    break
                time.sleep(0.05)
            lines.close()  # the connection closes with the socket: the command went away
        assert gone(pid) and gone(int(pidfile.read_text()))
        assert server.running(sock)["pid"] == facts["pid"]  # the server itself carries on
    finally:
        server.stop(sock)


def test_a_second_command_is_told_the_server_is_busy_and_stop_still_ends_it(running, sock, tmp_path):
    """The server serves one command at a time: while one holds it, another is told it is busy (and forks from a
    forkserver of its own); `serve --stop` ends it even then, its socket removed."""
    out = tmp_path / "c.out.log"
    assert running.run("tests.standin_worker:clean", ["x"], case_env(), out, 60).returncode == 0  # connected now
    facts = server.running(sock)
    assert facts["busy"] and facts["pid"] == running.facts["pid"]
    assert server.usable(sock)[0] is None and "serves another command" in server.usable(sock)[1]
    assert server.stop(sock)["pid"] == running.facts["pid"]
    assert gone(running.facts["pid"]) and not sock.exists()


def test_idle_server_stops_and_removes_its_socket(sock):
    facts = server.start(sock, idle_s=0.5, preload=STANDIN)
    assert gone(facts["pid"]) and not sock.exists()
    assert server.running(sock) is None


def test_a_server_of_other_code_is_not_used(running, sock, monkeypatch):
    from repro.run.executor import ForkExecutor
    from repro.run.runner import default_executor

    facts, why = server.usable(sock)
    assert facts is None and "runs other code" in why  # started with other preloads than a command uses
    monkeypatch.setattr(server, "code_fingerprint", lambda *a: running.facts["fingerprint"])
    facts, why = server.usable(sock)
    assert facts["pid"] == running.facts["pid"] and why == ""
    assert isinstance(default_executor(), server.ServerExecutor)
    monkeypatch.setattr(server, "code_fingerprint", lambda *a: "edited")
    assert isinstance(default_executor(), ForkExecutor)


def test_an_edit_changes_the_fingerprint():
    f = server.Path(server.__file__)
    st = f.stat()
    before = server.code_fingerprint()
    try:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
        assert server.code_fingerprint() != before
    finally:
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert server.code_fingerprint() == before


def _cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "repro", *args], capture_output=True, text=True, timeout=120, env=env)


def test_executor_server_without_one_is_refused_in_one_line(sock):
    from repro.errors import ConfigError
    from repro.run.runner import make_executor

    with pytest.raises(ConfigError, match=r"--executor server: no repro server at .* \(start one: python -m repro"):
        make_executor("server")


def test_cli_without_a_server(sock):
    env = {**os.environ, server.SOCKET_ENV: str(sock)}
    r = _cli("serve", "--status", env=env)
    assert r.returncode == 0 and "no repro server at" in r.stdout
    r = _cli("serve", "--stop", env=env)
    assert r.returncode == 0 and "no repro server" in r.stdout
    r = _cli("serve", "--idle", "0", env=env)
    assert r.returncode == 2 and "argument --idle: must be a positive, finite number of seconds" in r.stderr
    r = _cli("serve", env={**os.environ, server.SOCKET_ENV: "off"})
    assert r.returncode == 2 and "REPRO_SERVER=off" in r.stderr


def test_cli_starts_and_stops_a_server(sock):
    env = {**os.environ, server.SOCKET_ENV: str(sock)}
    r = _cli("serve", "--idle", "60", env=env)
    assert r.returncode == 0 and "repro server at" in r.stdout, r.stderr
    try:
        r = _cli("serve", "--status", env=env)
        assert "runs this code" in r.stdout
        assert "already runs this code" in _cli("serve", env=env).stdout
    finally:
        r = _cli("serve", "--stop", env=env)
    assert "stopped the repro server" in r.stdout and not sock.exists()


def test_doctor_says_whether_a_server_runs_this_code(sock, monkeypatch):
    from repro.cli.doctor import _server_line

    assert _server_line().startswith("none (`python -m repro serve`")
    facts = server.start(sock, idle_s=60, preload=STANDIN)
    try:
        assert "runs other code" in _server_line()  # started with other preloads than a command uses
        monkeypatch.setattr(server, "code_fingerprint", lambda *a: facts["fingerprint"])
        assert _server_line() == f"pid {facts['pid']}, runs this code: matrix forks its cases from it"
    finally:
        server.stop(sock)


def test_serve_on_cpu_says_it_is_of_no_use_and_stop_leaves_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REPRO_SERVER"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # the default socket folder: tmp_path/repro-<uid>/
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "repro", "serve", *a], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env
    )
    r = run("--idle", "60")
    try:
        no_traceback(r)
        assert r.returncode == 0 and "repro server at" in r.stdout, r.stderr
        assert r.stderr.startswith("note: no CUDA GPU here") and "of no use" in r.stderr
        assert len(list((tmp_path / f"repro-{os.getuid()}").glob("server-*.log"))) == 1
    finally:
        r = run("--stop")
    assert r.returncode == 0 and "stopped the repro server" in r.stdout
    assert not any(tmp_path.iterdir())  # no socket, no server.log, no repro-<uid>/


def test_two_checkouts_keep_a_server_each(tmp_path):
    """`serve` in a second checkout started its server on the first's socket, stopping the first's server."""
    other = tmp_path / "other-checkout"
    shutil.copytree(ROOT / "repro", other / "repro", ignore=shutil.ignore_patterns("__pycache__"))
    runtime = Path(tempfile.mkdtemp(prefix="r28-"))  # short: a socket's path holds 107 bytes, tmp_path's are long
    sock_dir = runtime / f"repro-{os.getuid()}"

    def serve(checkout: Path, *args: str) -> subprocess.CompletedProcess:
        env = {k: v for k, v in isolated_env(tmp_path, XDG_RUNTIME_DIR=str(runtime)).items() if k != "PYTHONPATH"}
        cmd = [sys.executable, "-m", "repro", "serve", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=checkout, env=env)

    try:
        first, second = serve(ROOT, "--idle", "120"), serve(other, "--idle", "120")
        assert first.returncode == 0 and second.returncode == 0, (first.stderr, second.stderr)
        a, b = serve(ROOT, "--status").stdout, serve(other, "--status").stdout
        assert "runs this code" in a and "runs this code" in b, (a, b)
        assert a.split(":")[0] != b.split(":")[0]  # "repro server at <socket>": two sockets
        assert len(list(sock_dir.glob("server-*.sock"))) == 2
    finally:
        stopped = [serve(ROOT, "--stop").stdout, serve(other, "--stop").stdout]
    left = list(runtime.iterdir())
    if not left:
        runtime.rmdir()
    assert all("stopped the repro server" in s for s in stopped), stopped
    assert not left, left  # both stopped: no socket, no log, no repro-<uid>/ folder left
