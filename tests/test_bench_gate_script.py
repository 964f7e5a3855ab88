"""scripts/bench-gate.sh, the default gate's speed benchmark, through a stand-in python: the gate run cold then warm
on one cache folder of its own, each record with its terminal output, the comparison with the previous record by
`records --speed ... --timeline`, nothing written over, only its own folders removed."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.records import ROOT

SCRIPT = ROOT / "scripts" / "bench-gate.sh"

STAND_IN = """#!/usr/bin/env bash
# a stand-in python: `-m repro gate ... --out DIR` makes DIR as the gate would; every call is logged
echo "$*" >> "$CALLS"
if [ "$2" = repro ] && [ "$3" = gate ]; then
  while [ $# -gt 0 ]; do
    case $1 in
      --out) mkdir "$2" && echo '{}' > "$2/results.json" ;;
      --cache-dir) ls -A "$2" | wc -l >> "$CALLS.cache"; touch "$2/filled" ;;
    esac
    shift
  done
  echo "[gate] cases at a time: 16"
  exit 1
fi
"""


@pytest.fixture
def bench(tmp_path):
    if shutil.which("bash") is None:
        pytest.skip("no bash on this machine: the benchmark script is a bash script")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("python3", "python"):
        (bin_dir / name).write_text(STAND_IN)
        (bin_dir / name).chmod(0o755)
    work = tmp_path / "checkout"
    (work / "results").mkdir(parents=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(tmp_path / "calls"),
           "TMPDIR": str(tmp_path)}  # fmt: skip

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(SCRIPT), *args], cwd=work, env=env, capture_output=True, text=True)

    return run, work, tmp_path


def test_the_benchmark_runs_the_gate_cold_then_warm_on_one_cache_and_compares_with_the_previous_record(bench):
    run, work, tmp = bench
    done = run("h100-x", "h100-gate-default-cold", "--", "--vllm", "0.34.0=/v")
    assert done.returncode == 0, done.stderr
    calls = (tmp / "calls").read_text().splitlines()
    gates = [c for c in calls if c.startswith("-m repro gate")]
    assert len(gates) == 2 and all(c.endswith("--vllm 0.34.0=/v") for c in gates)
    caches = {c.split("--cache-dir ")[1].split()[0] for c in gates}
    assert len(caches) == 1  # the warm run uses the folder the cold one filled
    assert (tmp / "calls.cache").read_text().split() == ["0", "1"]  # empty for the cold run, filled for the warm
    assert "--out results/h100-x-cold" in gates[0] and "--out results/h100-x-warm" in gates[1]
    assert calls[-1] == "-m repro records --speed h100-gate-default-cold h100-x-cold h100-x-warm --timeline"
    for r in ("cold", "warm"):
        assert "cases at a time: 16" in (work / "results" / f"h100-x-{r}" / "terminal.log").read_text()
        assert f"bench-gate: {r}: exit 1 in" in done.stdout  # the gate's exit code, said, not the script's
    assert not Path(next(iter(caches))).exists() and not list(tmp.glob("bench-gate-said.*"))  # its own folders only


def test_the_benchmark_refuses_a_name_whose_record_exists(bench):
    run, work, tmp = bench
    (work / "results" / "h100-x-warm").mkdir()
    done = run("h100-x")
    assert done.returncode == 2 and "results/h100-x-warm exists" in done.stderr
    assert not (tmp / "calls").exists()  # no gate ran


def test_bench_keep_adds_a_kept_run_that_reuses_the_warm_runs_forkserver(bench):
    run, work, tmp = bench
    done = subprocess.run(
        ["bash", str(SCRIPT), "h100-k", "--", "--vllm", "0.34.0=/v"], cwd=work, capture_output=True, text=True,
        env={**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}", "CALLS": str(tmp / "calls"),
             "TMPDIR": str(tmp), "BENCH_KEEP": "60"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    gates = [c for c in (tmp / "calls").read_text().splitlines() if c.startswith("-m repro gate")]
    assert [("--keep-forkserver 60" in g) for g in gates] == [False, True, True]  # cold stays the bare command
    assert [g.split("--out ")[1].split()[0] for g in gates] == [f"results/h100-k-{r}" for r in ("cold", "warm", "kept")]
    assert (tmp / "calls").read_text().splitlines()[-1].endswith("h100-k-cold h100-k-warm h100-k-kept --timeline")


@pytest.mark.parametrize("keep", ["1e9; rm", "0", "-5", "604801", "99999999999999999999"])
def test_bench_keep_refuses_a_value_that_is_no_whole_number_of_seconds(bench, keep):
    run, work, tmp = bench
    done = subprocess.run(
        ["bash", str(SCRIPT), "h100-k"], cwd=work, capture_output=True, text=True,
        env={**os.environ, "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}", "CALLS": str(tmp / "calls"),
             "TMPDIR": str(tmp), "BENCH_KEEP": keep},
    )  # fmt: skip
    assert done.returncode == 2 and "BENCH_KEEP" in done.stderr and not (tmp / "calls").exists()


@pytest.mark.parametrize("name", ["../../escape", "--help", "a b", ".hidden", "x/y"])
def test_a_name_that_is_no_record_name_is_refused_before_any_run(bench, name):
    run, work, tmp = bench
    done = run(name)
    assert done.returncode == 2 and "NAME" in done.stderr and not (tmp / "calls").exists()


def test_a_cold_run_that_left_no_record_stops_the_benchmark(bench, monkeypatch):
    run, work, tmp = bench
    for py in ("python3", "python"):  # a gate that refuses: no --out folder made
        (tmp / "bin" / py).write_text('#!/usr/bin/env bash\necho "$*" >> "$CALLS"\necho refused >&2\nexit 2\n')
    done = run("h100-y")
    calls = (tmp / "calls").read_text().splitlines()
    assert done.returncode == 2 and len([c for c in calls if c.startswith("-m repro gate")]) == 1
    assert "the cold run left no record" in done.stderr
