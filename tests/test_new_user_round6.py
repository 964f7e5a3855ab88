"""A demanding new user's sixth round (branch rev54), each guarantee a test: a duration no wait can take is refused
before any work."""

from __future__ import annotations

import pytest

from tests.commands import fake_vllm, refused_in

# 1. a duration past what Python's waits can take is bad input, never an OverflowError once the first case waits.


@pytest.mark.parametrize(
    "args",
    [
        ("gate", "--timeout", "2.2e6"),
        ("gate", "--deadline", "1e12"),
        ("gate", "--keep-forkserver", "1e20"),
        ("matrix", "--timeout", "1e9"),
        ("run", "--timeout", "1e9"),
        ("serve", "--idle", "1e9"),
    ],
    ids=lambda a: " ".join(a),
)
def test_a_duration_no_wait_can_take_is_refused_before_any_work(tmp_path, args):
    build = fake_vllm(tmp_path / "b", compiled=True)
    extra = ["--dry-run", "--no-installed", "--vllm", f"x={build}"] if args[0] == "gate" else []
    extra += ["--dry-run"] if args[0] == "matrix" else []
    refused_in([*args, *extra], tmp_path, 2, "at most 604800 seconds (a week)")


def test_a_kept_forkservers_idle_time_from_the_environment_is_held_to_the_same_week(tmp_path):
    build = fake_vllm(tmp_path / "b", compiled=True)
    args = ["gate", "--dry-run", "--no-installed", "--vllm", f"x={build}"]
    refused_in(args, tmp_path, 2, "REPRO_GATE_KEEP_FORKSERVER='1e9'", REPRO_GATE_KEEP_FORKSERVER="1e9")


def test_the_longest_wait_allowed_is_one_python_can_take():
    import threading

    from repro.run.process import MAX_WAIT_S

    assert not threading.Event().wait(min(MAX_WAIT_S, 1e-3))  # the bound itself: a week is far below 24.8 days
    assert MAX_WAIT_S * 1000 < 2**31 - 1  # poll's timeout: milliseconds in a C int
