"""The gate's pytest options (repro/pytest_options.py) as pytest users type them: `--gate-report DIR` with a space,
a requirement no runner knows (exit 2, with or without --gate), and the options in a checkout used without
`pip install -e .`. Each a pytest run of its own in the checkout."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.commands import ROOT, isolated_env, no_traceback, tree


def _pytest_cmd(*args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "-m",
        "gpu",
        "-k",
        "stale_metadata and pair",
        *args,
        "cases",  # the selected cases' folder: collecting tests/ too imports every test module (3x the CPU time)
    ]


def _pytest(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    """A pytest run of its own in the checkout (not this run's xdist worker, log folder or GPU probe)."""
    full = {
        k: v for k, v in isolated_env(tmp_path, **env).items() if not k.startswith(("PYTEST_XDIST", "REPRO_RUN_LOG"))
    }
    full = {k: v for k, v in full.items() if not k.startswith(("REPRO_GPU_PROBE", "REPRO_GATE"))} | env
    return subprocess.run(_pytest_cmd(*args), capture_output=True, text=True, timeout=600, cwd=ROOT, env=full)


def test_gate_report_with_a_space_roots_the_run_in_the_checkout(tmp_path):
    """`--gate-report DIR` with DIR an existing folder outside the checkout: pytest picks its rootdir before any
    plugin, so it took DIR for a test path ("unrecognized arguments: --gate --gate-report"); now the same run as
    `--gate-report=DIR`."""
    out = tmp_path / "gate-out"
    out.mkdir()
    spaced = _pytest(tmp_path, "--co", "--gate-report", str(out))
    assert f"rootdir: {ROOT}" in spaced.stdout and "configfile: pyproject.toml" in spaced.stdout, spaced.stdout[:2000]
    assert spaced.returncode == 0 and "ignored: the gate's options take effect in a gate run only" in spaced.stderr
    for form in (("--gate-report", str(out)), (f"--gate-report={out}",)):
        r = _pytest(tmp_path, "-q", "--gate", *form)
        no_traceback(r)
        assert "unrecognized arguments" not in r.stderr, r.stderr
        if "GATE FAILED: no GPU case can run here" in r.stdout + r.stderr:  # no GPU here: one line, exit 1
            assert r.returncode == 1, (form, r.returncode, r.stderr)
    assert not any(out.iterdir())  # the gate stopped before any case ran: no report to write


@pytest.mark.parametrize(
    "args, env, msg",
    [
        (("--gate-require", "bogus"), {}, "--gate-require bogus: unknown gate requirement"),
        (("--gate", "--gate-require", "mig,bogus"), {}, "--gate-require mig,bogus: unknown gate requirement"),
        (("--gate",), {"REPRO_GATE_REQUIRE": "bogus"}, "REPRO_GATE_REQUIRE=bogus: unknown gate requirement"),
    ],
)
def test_gate_require_bogus_is_bad_input_with_or_without_gate(tmp_path, args, env, msg):
    isolated_env(tmp_path)  # the temp folder exists before
    before = tree(tmp_path)
    r = _pytest(tmp_path, *args, **env)
    no_traceback(r)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, (r.returncode, r.stderr)
    assert tree(tmp_path) == before


def test_the_options_come_from_conftest_without_the_entry_point(tmp_path):
    """A checkout used without `pip install -e .`: conftest.py loads the same plugin (registered once either way)."""
    r = _pytest(tmp_path, "--co", "-q", "--gate-require", "bogus", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")
    assert r.returncode == 2 and "--gate-require bogus: unknown gate requirement" in r.stderr, r.stderr
