"""Kept forkservers (repro.vllm_integration.gate.keep, repro.run.kept, repro.run.forkserver.listen): one gate run at a time per forkserver (a second
is told it is busy at once), the next run served after the first ends, a run from another folder gets its files
where it asked, and the settings that decide whether a run keeps its forkservers."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from repro.errors import ConfigError
from repro.run import forkserver as fs
from repro.run import kept
from repro.vllm_integration.gate import keep as gate_keep


@pytest.fixture
def short_dir(monkeypatch):
    d = tempfile.mkdtemp(prefix="k", dir="/tmp")  # a Unix socket's path holds at most 107 bytes
    monkeypatch.setenv("XDG_RUNTIME_DIR", d)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)  # outside tmp_path: removed here, or every run leaves one in /tmp


def _first(sock) -> dict:
    buf = b""
    while b"\n" not in buf:
        chunk = sock.recv(1 << 16)
        if not chunk:
            break
        buf += chunk
    return fs.decode(buf.split(b"\n", 1)[0])


def test_one_run_at_a_time_a_second_is_told_busy_and_the_next_is_served(short_dir):
    path = gate_keep.socket_dir() / "t.sock"
    cmd = [sys.executable, "-m", "repro.run.forkserver", "--preload", "json", "--late", ""]
    proc = kept.start(cmd, dict(os.environ), path, idle_s=3.0)
    try:
        first = kept.wait_connect(path, proc, 60)
        assert first is not None and _first(first)["kind"] == fs.READY
        second = kept.try_connect(path)
        refused = _first(second)
        assert refused["kind"] == fs.REFUSED and refused["busy"] is True and "busy" in refused["reason"]
        first.sendall(fs.encode(fs.STOP))
        first.close()
        third, first_line, reader = kept.take(None, path, proc, 10)  # asked again while it says busy
        ready = fs.decode(first_line)
        assert ready["kind"] == fs.READY and ready["served"] == 2
        reader.close()
        third.close()
        proc.wait(timeout=20)  # idle: it exits and takes its socket with it
        assert proc.returncode == 0 and not path.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_what_decides_whether_a_run_keeps_its_forkservers(short_dir):
    assert gate_keep.keep_seconds(None, forking=True, environ={}) is None
    assert gate_keep.keep_seconds(30.0, forking=True, environ={}) == 30.0
    assert gate_keep.keep_seconds(None, forking=True, environ={gate_keep.KEEP_ENV: "45"}) == 45.0
    assert gate_keep.keep_seconds(None, forking=False, environ={gate_keep.KEEP_ENV: "45"}) is None  # spawn: ignored
    assert gate_keep.keep_seconds(None, forking=True, environ={gate_keep.KEEP_ENV: "0"}) is None
    for bad in ("abc", "-5", "nan"):
        with pytest.raises(ConfigError, match=gate_keep.KEEP_ENV):
            gate_keep.keep_seconds(None, forking=True, environ={gate_keep.KEEP_ENV: bad})
    with pytest.raises(ConfigError, match="--launcher fork"):
        gate_keep.keep_seconds(30.0, forking=False, environ={})


def test_a_socket_folder_others_may_enter_is_refused(short_dir):
    d = gate_keep.socket_dir()
    d.chmod(0o755)
    with pytest.raises(ConfigError, match="not this user's alone"):
        gate_keep.socket_dir()


def test_the_socket_changes_with_the_build_environment_and_preload(short_dir):
    base = kept.socket_for(gate_keep.socket_dir(), "b", {"A": "1"}, ("torch",), frozenset({"X"}), "0.26.0|x")
    assert base == kept.socket_for(gate_keep.socket_dir(), "b", {"A": "1"}, ("torch",), frozenset({"X"}), "0.26.0|x")
    others = [
        kept.socket_for(gate_keep.socket_dir(), "b", {"A": "2"}, ("torch",), frozenset({"X"}), "0.26.0|x"),
        kept.socket_for(gate_keep.socket_dir(), "b", {"A": "1"}, ("torch", "vllm"), frozenset({"X"}), "0.26.0|x"),
        kept.socket_for(gate_keep.socket_dir(), "b", {"A": "1"}, ("torch",), frozenset({"X"}), "0.26.0|reinstalled"),
    ]
    assert base not in others and len(set(others)) == 3
    assert len(os.fsencode(base)) < 108


def test_the_kept_paths_of_compare_paths_fork_the_warm_run_from_the_forkserver_the_cold_one_left(
    short_dir, tmp_path, monkeypatch
):
    from repro.vllm_integration.gate import paths as gate_paths
    from repro.vllm_integration.gate.modes import parse_modes
    from repro.vllm_integration.gate.paths import KEPT_COLD, KEPT_WARM, compare_paths, parse_paths
    from repro.vllm_integration.releases.builds import UNDER_TEST, parse_builds
    from tests.fake_vllm import write_fake_vllm

    for name in (KEPT_COLD, KEPT_WARM):  # the stand-in's forkserver idles out soon after the test
        monkeypatch.setitem(gate_paths.HOW, name, (*gate_paths.HOW[name][:2], 5.0))
    builds = parse_builds(f"good={write_fake_vllm(tmp_path / 'good', '0.26.0', 'good')}", UNDER_TEST, "x")
    assert parse_paths(None, True)[-1] == "fork (warm)"  # the kept paths only when named
    paths = parse_paths("kept-cold,kept-warm", True)
    runs = compare_paths(builds, parse_modes("plain"), tmp_path / "l", tmp_path / "c", timeout_s=120, paths=paths)
    assert list(runs) == [KEPT_COLD, KEPT_WARM]
    kept = {name: run.launches["good"]["forkserver"]["kept"] for name, run in runs.items()}
    assert kept[KEPT_COLD]["reused"] is False and kept[KEPT_WARM]["reused"] is True, kept
    for run in runs.values():
        assert {(r.phases or {}).get("launcher") for _, r in run.cases} == {"fork"}
        assert [r.verdict for _, r in run.cases] == [r.verdict for _, r in runs[KEPT_COLD].cases]
