"""`gate` refuses an option another option makes moot, before anything runs or is written (exit 2, one line), rather
than ignore it; an SM count in a mode is plain digits, refused alike by `gate --modes` and the pytest tier's
REPRO_GATE_MODES, the mode named."""

from __future__ import annotations

import re

import pytest

from repro.errors import ConfigError
from tests.commands import fake_vllm, main_in, refused_in


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--no-cache", "--cache-keep", "5"], "--cache-keep would be ignored: --no-cache keeps no cache"),
        (["--cache-keep", "12", "--no-cache"], "--cache-keep would be ignored: --no-cache keeps no cache"),
        (
            ["--self-control", "none", "--self-control-attempts", "2"],
            "--self-control-attempts would be ignored: --self-control none runs no self control",
        ),
        (["--dry-run", "--out", "report"], "--out would be ignored: --dry-run only lists the case ids"),
        (
            ["--self-control", "none", "--name-control-kernels"],
            "--name-control-kernels would be ignored: --self-control none runs no self control",
        ),
        (["--modes", "audit", "--name-control-kernels"], "--name-control-kernels would be ignored: no plain mode"),
        (
            ["--compare-paths", "--name-control-kernels"],
            "--name-control-kernels would be ignored: --compare-paths runs its paths without it",
        ),
    ],
)
def test_the_gate_refuses_an_option_another_makes_moot_before_anything_runs(tmp_path, args, msg):
    build = fake_vllm(tmp_path / "b", compiled=True)
    refused_in(["gate", "--no-installed", "--vllm", f"x={build}", *args], tmp_path, 2, msg)


def test_the_gate_takes_each_of_those_options_alone_and_their_defaults_beside_the_other(tmp_path):
    build = fake_vllm(tmp_path / "b", compiled=True)
    base = ["gate", "--dry-run", "--no-installed", "--vllm", f"x={build}"]
    for args in (
        ["--no-cache"],
        ["--cache-keep", "5"],
        ["--self-control", "none"],
        ["--self-control-attempts", "2"],
        ["--name-control-kernels"],
    ):
        r = main_in([*base, *args], tmp_path)
        assert r.returncode == 0 and "stale_metadata-vllm-x-" in r.stdout, (args, r.stderr[-2000:])


BAD_COUNTS = ["sm_margin:1_6", "mps:+5", "sm_margin: 16", "mps:١٦", "audit+sm_margin:0x10", "audit+mps:1_6"]


@pytest.mark.parametrize("mode", BAD_COUNTS)
def test_an_sm_count_in_a_gate_mode_is_plain_digits_or_refused_naming_the_mode(tmp_path, mode):
    named = mode.removeprefix("audit+")
    refused_in(["gate", "--dry-run", "--modes", mode], tmp_path, 2, f"bad SM configuration {named!r}")


@pytest.mark.parametrize("mode", BAD_COUNTS)
def test_the_pytest_tier_refuses_a_mode_the_gate_refuses_alike(mode):
    from cases.test_vllm_gate import settings

    named = mode.removeprefix("audit+")
    with pytest.raises(ConfigError, match=re.escape(f"REPRO_GATE_MODES={mode!r}: bad SM configuration {named!r}")):
        settings({"REPRO_GATE_MODES": mode})


def test_an_sm_count_in_plain_digits_is_taken_by_both():
    from cases.test_vllm_gate import settings

    modes = settings({"REPRO_GATE_MODES": "sm_margin:16,mps:8,audit+mps:016"})["modes"]
    assert [m.name for m in modes] == ["sm_margin:16", "mps:8", "audit+mps:16"]
