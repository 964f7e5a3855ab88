"""Every command explains itself: each option and positional has a help text that shows its default, and the
module entry points (the bisect step, repro.run.smcontrol) answer --help."""

from __future__ import annotations

import argparse
import sys

import pytest

from tests.commands import main_in, run_in, subcommands


def test_matrix_help_names_every_default(tmp_path):
    r = main_in(["matrix", "--help"], tmp_path)
    options = r.stdout.split("options:", 1)[1]
    for flag in ("--backends", "--strategies", "--sms", "--modes", "--splits", "--repeat", "--poison", "--jobs"):
        block = options.split(flag, 1)[1].split("\n  --", 1)[0]
        assert "default" in block, flag


def test_every_option_and_positional_has_help_and_shows_its_default(capsys):
    from repro.cli import main  # in this process: each subcommand's --help is argparse's, no process of its own

    for name, sub in subcommands().items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{what}: no help"
            trivial = action.default in (None, False, [], argparse.SUPPRESS)
            assert trivial or "default" in action.help, f"{what}: default {action.default!r} not shown"
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        out, err = capsys.readouterr()
        assert exit_.value.code == 0 and out.startswith("usage: python -m repro") and not err, name


def step(*args: str) -> list[str]:
    return [sys.executable, "-m", "repro.vllm_integration.releases.bisect", "step", *args]


def test_bisect_step_and_smcontrol_explain_themselves(tmp_path):
    r = run_in(step("--help"), tmp_path)
    assert r.returncode == 0 and not r.stderr
    for flag in ("--repo", "--check", "--overlay"):
        block = r.stdout.split(f"  {flag}", 1)[1].split("\n  -", 1)[0]
        assert len(block.split()) > 3, (flag, block)  # a help text, not just the metavar
    r = run_in([sys.executable, "-m", "repro.run.smcontrol", "--help"], tmp_path)
    assert r.returncode == 0 and not r.stderr and r.stdout.startswith("usage: python -m repro.run.smcontrol")
