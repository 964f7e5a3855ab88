"""The harness's one forkserver (repro.run.forkserver) as each of its users takes it: a case forks only from a
forkserver whose imports saw what the case would have seen (its environment compared with the one the forkserver
really started with, a kept one's too; a per-case variable its imports read; the interpreter's, locale's and thread
pools' variables), else it starts fresh and the executor names it; the repro server refuses in one line when its
forkserver refused, is taken by one command at a time (another forks from its own), stops when asked even while busy,
and never removes a newer server's socket; a forkserver told to end while importing ends, not refuses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repro.errors import ConfigError
from repro.run import kept, server
from repro.run.executor import ForkExecutor
from repro.run.process import case_env
from tests.processes import alive, gone

STANDIN = ("tests.standin_worker",)
TARGETS = frozenset({"tests.standin_worker:clean"})


@pytest.fixture
def sock(tmp_path, monkeypatch):
    path = tmp_path / "s" / "server.sock"
    path.parent.mkdir()
    monkeypatch.setenv(server.SOCKET_ENV, str(path))
    return path


def _module(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(exist_ok=True)
    (folder / f"{name}.py").write_text(text)
    return folder


def _clean(ex, tmp_path, env, name="c"):
    return ex.run("tests.standin_worker:clean", ["x"], env, tmp_path / f"{name}.out.log", 60)


def test_a_per_case_variable_the_imports_read_keeps_the_case_from_forking(tmp_path):
    mods = _module(tmp_path / "m", "reads_gpu", "import os\nSEEN = os.environ.get('CUDA_VISIBLE_DEVICES')\n")
    env = case_env({**os.environ, "PYTHONPATH": f"{mods}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    ex = ForkExecutor(env, preload=(*STANDIN, "reads_gpu"), spares=0, targets=TARGETS)
    try:
        assert _clean(ex, tmp_path, {**env, "CUDA_VISIBLE_DEVICES": "7"}, "gpu7") is None
        assert any("CUDA_VISIBLE_DEVICES" in n and "gpu7" in n for n in ex.notes)
    finally:
        ex.close()


@pytest.mark.parametrize("var", ["PYTHONHASHSEED", "OMP_NUM_THREADS", "PYTHONWARNINGS", "LC_ALL"])
def test_a_variable_read_when_the_interpreter_starts_keeps_the_case_from_forking(tmp_path, var):
    ex = ForkExecutor(case_env(), preload=STANDIN, spares=0, targets=TARGETS)
    try:
        assert _clean(ex, tmp_path, {**case_env(), var: "0"}) is None
        assert any(var in n and "c.out.log" in n for n in ex.notes), ex.notes
        assert _clean(ex, tmp_path, {**case_env(), "SOME_SHELL_VAR": "1"}, "d").returncode == 0  # free to differ
    finally:
        ex.close()


def test_the_repro_server_s_own_environment_is_what_a_case_is_compared_with(sock, tmp_path, monkeypatch):
    """Started from a shell whose Python path differs from the command's: the command's cases start fresh, named,
    though the command's own guess of the server's environment (its case_env) matched."""
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path / 'elsewhere'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    facts = server.start(sock, idle_s=60, preload=STANDIN)
    monkeypatch.undo()
    monkeypatch.setenv(server.SOCKET_ENV, str(sock))
    ex = server.ServerExecutor(sock, facts, targets=TARGETS)
    try:
        assert _clean(ex, tmp_path, case_env()) is None
        assert any("PYTHONPATH" in n for n in ex.notes), ex.notes
    finally:
        ex.close()
        server.stop(sock)


def test_a_server_that_refused_is_no_server_and_serve_says_why(sock):
    with pytest.raises(ConfigError, match="refused to serve: import failed: ModuleNotFoundError"):
        server.start(sock, idle_s=60, preload=("no_such_module_anywhere",))
    assert server.running(sock) is None and not sock.exists()


def test_a_command_that_finds_the_server_taken_forks_from_its_own(sock, tmp_path):
    facts = server.start(sock, idle_s=60, preload=STANDIN)
    first = server.ServerExecutor(sock, facts, targets=TARGETS)
    second = server.ServerExecutor(sock, facts, targets=TARGETS)
    try:
        assert _clean(first, tmp_path, case_env(), "a").returncode == 0  # holds the server now
        assert _clean(second, tmp_path, case_env(), "b").returncode == 0  # forked all the same
        assert "of its own" in second.started_by and "busy" in second.started_by and not second.notes
        assert "repro server" in first.started_by
    finally:
        first.close()
        second.close()
        server.stop(sock)
    assert gone(facts["pid"])


def test_an_idle_server_never_removes_a_newer_server_s_socket(sock):
    import socket as sockets

    facts = server.start(sock, idle_s=1.0, preload=STANDIN)
    sock.unlink()  # another server took the path since (serve's restart): its socket, bound there now
    newer = sockets.socket(sockets.AF_UNIX, sockets.SOCK_STREAM)
    newer.bind(str(sock))
    try:
        assert gone(facts["pid"], within_s=15)
        assert sock.is_socket()
    finally:
        newer.close()


def test_a_kept_forkserver_told_to_end_while_importing_ends_at_once(tmp_path):
    mods = _module(tmp_path / "m", "slow_import", "import time\ntime.sleep(30)\n")
    path = Path(kept.private_dir("t-" + tmp_path.name[-8:])) / "k.sock"
    env = case_env({**os.environ, "PYTHONPATH": f"{mods}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    cmd = [sys.executable, "-m", "repro.run.forkserver", "--preload", "slow_import"]
    proc = kept.start(cmd, env, path, idle_s=60)
    try:
        time.sleep(1.5)
        os.kill(proc.pid, signal.SIGTERM)
        assert proc.wait(timeout=10) == 0 and not path.exists()  # no socket bound to refuse a client for 60 s
        assert "import failed" not in kept.log_of(path).read_text()
    finally:
        if alive(proc.pid):
            proc.kill()
        kept.log_of(path).unlink(missing_ok=True)
        subprocess.run(["rm", "-rf", str(path.parent)], check=False)


def test_the_readme_matrix_on_the_one_forkserver_gives_the_same_verdicts_every_case_forked():
    """results/h200-matrix-readme-2 (the README's matrix on the one-forkserver code, 14085c4) against
    results/h200-matrix-readme (the stdlib forkserver before it): the same verdict for every case, and every case
    started by the forkserver (the report's line names none started fresh)."""
    import json

    from tests.records import RESULTS

    new, old = (
        json.loads((RESULTS / n / "results.json").read_text()) for n in ("h200-matrix-readme-2", "h200-matrix-readme")
    )
    verdicts = [{c["case"]: c["verdict"] for c in d["cases"]} for d in (new, old)]
    assert verdicts[0] == verdicts[1] and len(verdicts[0]) == 48
    assert sorted(set(verdicts[0].values())) == ["clean", "crash"]
    assert new["environment"]["cases started by"] == "a forkserver"


def _serve(sock, *args):
    env = {**os.environ, server.SOCKET_ENV: str(sock)}
    cmd = [sys.executable, "-m", "repro", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_serve_and_doctor_say_a_server_is_busy_and_never_restart_one_that_serves_a_command(sock, tmp_path, monkeypatch):
    """A server of other code (here: other preloads) that serves a command now: `serve --status` and doctor say it
    is busy; `serve` refuses to restart it (its command's cases would end) and names `serve --stop`; `--stop` ends
    it and names its pid."""
    from repro.cli.doctor import _server_line

    facts = server.start(sock, idle_s=60, preload=STANDIN)
    holder = server.ServerExecutor(sock, facts, targets=TARGETS)
    try:
        assert _clean(holder, tmp_path, case_env()).returncode == 0  # it holds the server now
        status = _serve(sock, "--status")
        assert status.returncode == 0 and "serves a command now" in status.stdout, status.stdout
        monkeypatch.setattr(server, "code_fingerprint", lambda *a: facts["fingerprint"])
        assert _server_line().endswith("(it serves another command now: one at a time)")
        again = _serve(sock)
        assert again.returncode == 2 and "serves a command now" in again.stderr and "serve --stop" in again.stderr
        assert alive(facts["pid"])  # not restarted under the command
    finally:
        holder.close()
    stopped = _serve(sock, "--stop")
    assert stopped.returncode == 0 and f"stopped the repro server (pid {facts['pid']})" in stopped.stdout
    assert gone(facts["pid"])


def test_doctor_and_status_name_a_server_that_refused_never_call_it_running(sock, monkeypatch):
    """A forkserver kept at the server's socket that refused (an import failed) answers its first client with why,
    then exits: doctor says so; `serve --status` then finds none."""
    from repro.cli.doctor import _server_line

    cmd = [sys.executable, "-m", "repro.run.forkserver", "--preload", "no_such_module_anywhere"]
    proc = kept.start(cmd, case_env(), sock, idle_s=60)
    try:
        for _ in range(200):
            if sock.exists():
                break
            time.sleep(0.05)
        line = _server_line()
        assert "refused to serve (import failed: ModuleNotFoundError" in line and "has exited" in line, line
        assert proc.wait(timeout=10) == 0
        assert "no repro server at" in _serve(sock, "--status").stdout
    finally:
        if proc.poll() is None:
            proc.kill()
