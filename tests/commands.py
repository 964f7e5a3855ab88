"""What the tests that run the harness's commands as subprocesses share (not collected: no test_ prefix): this
checkout's `python -m repro` run from any folder, an environment whose temp folder lies inside tmp_path, the checks
every refusal must pass (one line on stderr, the exit code, no traceback, nothing written), and a stand-in vLLM
build folder."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _this_checkout_first(env: dict[str, str]) -> str:
    """PYTHONPATH with this checkout first: run from another folder, the interpreter would otherwise import whichever
    checkout its environment installed."""
    return os.pathsep.join(filter(None, (str(ROOT), env.get("PYTHONPATH"))))


def run_repro(*args: str, cwd: str | Path | None = None) -> subprocess.CompletedProcess:
    """`python -m repro ...` of this checkout, run in `cwd` (default: the checkout)."""
    env = {**os.environ, "PYTHONPATH": _this_checkout_first(dict(os.environ))}
    return subprocess.run(
        [sys.executable, "-m", "repro", *args], capture_output=True, text=True, timeout=300, cwd=cwd or ROOT, env=env
    )


def repro_cmd(*args: str) -> list[str]:
    """The command line of `python -m repro ...`, for run_in and refused."""
    return [sys.executable, "-m", "repro", *args]


def isolated_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This environment with its temp and runtime folders inside tmp_path (made here), no server or vLLM builds named,
    this checkout first on PYTHONPATH."""
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("REPRO_SERVER", "REPRO_VLLM", "REPRO_VLLM_CONTROL")}
    return {**env, "PYTHONPATH": _this_checkout_first(env), "TMPDIR": str(tmp), "XDG_RUNTIME_DIR": str(tmp), **extra}


def run_in(cmd: list[str], tmp_path: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    """`cmd` run in tmp_path under isolated_env."""
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, cwd=tmp_path, env=isolated_env(tmp_path, **env)
    )


@contextlib.contextmanager
def as_a_process(cwd: Path, env: dict[str, str]):
    """This process made to look as `run_in`'s child would: cwd, os.environ replaced by env, the temp folder read from
    it afresh; each put back on the way out."""
    saved_env, saved_cwd, saved_tmp = dict(os.environ), os.getcwd(), tempfile.tempdir
    os.environ.clear()
    os.environ.update(env)
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(saved_cwd)
        os.environ.clear()
        os.environ.update(saved_env)
        tempfile.tempdir = saved_tmp


def main_in(
    args: list[str], tmp_path: Path, cwd: Path | None = None, entry=None, **env: str
) -> subprocess.CompletedProcess:
    """`python -m repro ARGS` through repro.cli.main (or another module's main, `entry`) in this process (no
    interpreter to start, nothing to import again): in cwd (default tmp_path) under isolated_env(tmp_path), stdout and
    stderr captured, argparse's SystemExit taken as the exit code. A traceback would be an exception raised here,
    failing the test that called it. Each entry point keeps tests that run it as a real subprocess (run_repro, run_in,
    refused)."""
    if entry is None:
        from repro.cli import main as entry  # the command line's entry, as `python -m repro` calls it

    out, err = io.StringIO(), io.StringIO()
    with as_a_process(cwd or tmp_path, isolated_env(tmp_path, **env)):
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = entry(list(args))
            except SystemExit as e:
                if isinstance(e.code, str):  # as the interpreter does: the message on stderr, exit 1
                    print(e.code, file=sys.stderr)
                code = e.code if isinstance(e.code, int) else int(e.code is not None)
    return subprocess.CompletedProcess(["python", "-m", "repro", *args], int(code), out.getvalue(), err.getvalue())


def refused_in(
    args: list[str], tmp_path: Path, code: int, msg: str, entry=None, **env: str
) -> subprocess.CompletedProcess:
    """refused() for `python -m repro ARGS` (or `entry`) run in this process (main_in): one line on stderr holding
    `msg`, exit `code`, nothing new anywhere under tmp_path."""
    isolated_env(tmp_path)  # the temp folder exists before, so it is no change
    before = tree(tmp_path)
    r = main_in(args, tmp_path, entry=entry, **env)
    assert r.returncode == code, (args, r.returncode, r.stderr[-2000:])
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, (args, r.stderr[-2000:])
    assert tree(tmp_path) == before, sorted(map(str, tree(tmp_path) - before))
    return r


def tree(tmp_path: Path) -> set[Path]:
    """Everything under tmp_path but Python's bytecode caches."""
    return {p for p in tmp_path.rglob("*") if "__pycache__" not in p.parts}


def no_traceback(r: subprocess.CompletedProcess) -> None:
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-2000:]


def one_line_nothing_written(r: subprocess.CompletedProcess, tmp_path: Path, before: set[Path], code: int, msg: str):
    """`r` exited `code` with one line on stderr holding `msg`, no traceback, and tmp_path holds what it held."""
    no_traceback(r)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr
    assert set(tmp_path.rglob("*")) == before


def refused(cmd: list[str], tmp_path: Path, code: int, msg: str, timeout: float = 300, **env: str):
    """Run `cmd` in tmp_path (TMPDIR inside it): one line on stderr holding `msg`, exit `code`, no traceback, nothing
    new anywhere under tmp_path."""
    isolated_env(tmp_path)  # the temp folder exists before, so it is no change
    before = tree(tmp_path)
    r = run_in(cmd, tmp_path, timeout, **env)
    no_traceback(r)
    assert r.returncode == code, (cmd, r.returncode, r.stderr[-2000:])
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, (cmd, r.stderr[-2000:])
    assert tree(tmp_path) == before, sorted(map(str, tree(tmp_path) - before))
    return r


def fake_vllm(prefix: Path, compiled: bool) -> Path:
    """A folder holding a `vllm` package; with a compiled extension it looks like a real (GPU) build."""
    (prefix / "vllm").mkdir(parents=True)
    (prefix / "vllm" / "__init__.py").write_text('__version__ = "0.25.1"\n')
    if compiled:
        (prefix / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    return prefix


def subcommands() -> dict:
    """`python -m repro`'s subcommands: name -> its parser."""
    from repro.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    return sub.choices


def one_commit(repo: Path, file: str) -> Path:
    """A git checkout at `repo` holding one empty file, in one commit."""
    (repo / file).parent.mkdir(parents=True)
    (repo / file).write_text("")
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, capture_output=True)
    return repo
