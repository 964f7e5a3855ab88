"""What the tests that run the harness's commands as subprocesses share (not collected: no test_ prefix): this
checkout's `python -m repro` run from any folder, an environment whose temp folder lies inside tmp_path, the checks
every refusal must pass (one line on stderr, the exit code, no traceback, nothing written), and a stand-in vLLM
build folder."""

from __future__ import annotations

import os
import subprocess
import sys
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
