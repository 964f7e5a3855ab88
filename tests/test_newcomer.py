"""Every command as a newcomer types it, on a machine without a GPU, as a subprocess: the exit code a script can test,
one line on stderr for bad input, never a traceback, nothing written where nobody asked."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
H200_RUN = ROOT / "results" / "h200-default" / "results.json"


def _repro(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "repro", *args], capture_output=True, text=True, timeout=300, cwd=cwd or ROOT
    )


def _no_traceback(r):
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-2000:]


@pytest.fixture
def files(tmp_path):
    (tmp_path / "empty.json").write_text("")
    (tmp_path / "corrupt.json").write_text("{not json")
    (tmp_path / "obj.json").write_text("{}")
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "corrupt.xml").write_text("<testsuite><testcase")
    (tmp_path / "folder").mkdir()
    return tmp_path


BAD = [
    (["matrix", "--strategies", "bogus"], "unknown strategy"),
    (["matrix", "--sms", "sm_margin:x"], "bad SM configuration"),
    (["matrix", "--modes", "sideways"], "unknown mode"),
    (["matrix", "--repeat", "0"], "--repeat"),
    (["matrix", "--sanitizer", "--sms", "green:16"], "CPU model predicts"),
    (["matrix", "--scenario", "spec-decode"], "--scenario v2-capture only"),
    (["matrix", "--modes", "eager,graph"], "eager warmups only"),
    (["matrix", "--json", "/proc/x.json"], "cannot write"),
    (["matrix", "--json", "@folder"], "is a folder"),
    (["matrix", "--out", "/proc/foo"], "cannot create"),
    (["agree", "@empty.json"], "not a results.json"),
    (["agree", "@corrupt.json"], "not a results.json"),
    (["agree", "@obj.json"], "not a results.json"),
    (["agree", "@list.json"], "not a results.json"),
    (["bench", "@obj.json", "@corrupt.json"], "not a results.json"),
    (["bench", "@obj.json"], "one of the two"),
    (["bench", "--paths", "@obj.json", "@corrupt.json"], "not a results.json"),
    (["matrix", "--model", "--executor", "process"], "the CPU model runs none"),
    (["matrix", "--compare-executors"], "the CPU model runs none"),
    (["xdist-report", "@corrupt.xml"], "not a JUnit XML"),
    (["run", "--backend", "vllm", "--poison", "banana"], "bad poison"),
    (["gate", "--modes", "bogus", "--vllm", "x=/nonexistent"], "unknown gate mode"),
    (["gate", "--no-installed", "--vllm", "x=/nonexistent"], "holds no vllm package"),
]


@pytest.mark.parametrize("args, msg", BAD, ids=[" ".join(a)[:60] for a, _ in BAD])
def test_bad_input_is_one_line_exit_2_nothing_written(files, args, msg):
    args = [str(files / a[1:]) if a.startswith("@") else a for a in args]
    before = set(files.rglob("*"))
    r = _repro(*args, cwd=files)
    _no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr
    assert set(files.rglob("*")) == before  # no partial report, no ./results/latest


def test_matrix_without_gpu_writes_only_where_asked(tmp_path):
    r = _repro("matrix", cwd=tmp_path)
    _no_traceback(r)
    assert r.returncode == 0 and r.stdout.startswith("No GPU here") and not any(tmp_path.iterdir())
    out = tmp_path / "out"
    r = _repro("matrix", "--out", str(out), "--json", str(tmp_path / "m.json"), "--model-sms", "16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in out.iterdir()} >= {"verdicts.md", "results.json"}  # heatmap.png too with matplotlib
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["source"] == "model" and doc["schema"] == 2 and len(doc["cases"]) == 8


def test_agree_accepts_what_matrix_writes(tmp_path):
    assert _repro("matrix", "--json", str(tmp_path / "m.json"), "--model-sms", "16").returncode == 0
    r = _repro("agree", str(tmp_path / "m.json"))
    _no_traceback(r)
    assert r.returncode == 2 and "no GPU run to compare with" in r.stderr  # predictions only: said, not a TypeError
    r = _repro("agree", str(tmp_path / "m.json"), str(H200_RUN))
    assert r.returncode == 0 and "left out" in r.stderr and "Verdicts agree in" in r.stdout


def test_poison_none_and_no_poison_mean_the_same_case():
    a = _repro("matrix", "--dry-run", "--poison", "none").stdout.split()
    b = _repro("matrix", "--dry-run", "--poison", "0").stdout.split()
    assert a and all("poison" not in x for x in a) and all(x.endswith("poison-0") for x in b)


def test_matrix_help_names_every_default():
    r = _repro("matrix", "--help")
    options = r.stdout.split("options:", 1)[1]
    for flag in ("--backends", "--strategies", "--sms", "--modes", "--splits", "--repeat", "--poison", "--jobs"):
        block = options.split(flag, 1)[1].split("\n  --", 1)[0]
        assert "default" in block, flag


def test_vllm_check_exit_codes(tmp_path):
    r = _repro("vllm-check", str(tmp_path))
    assert r.returncode == 125 and "untestable" in r.stdout


def test_matrix_gate_without_gpu_fails(tmp_path):
    r = _repro("matrix", "--gate", "--model-sms", "16", cwd=tmp_path)
    _no_traceback(r)
    assert r.returncode == 1 and "GATE FAILED" in r.stderr


def test_bisect_names_a_revision_git_does_not_know(tmp_path):
    repo = tmp_path / "vllm-src"
    (repo / "vllm").mkdir(parents=True)
    (repo / "vllm" / "__init__.py").write_text("")
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, capture_output=True)
    r = _repro("bisect", "--vllm", str(repo), "--good", "nosuchtag")
    _no_traceback(r)
    assert r.returncode == 2 and "--good nosuchtag: git knows no such commit" in r.stderr
