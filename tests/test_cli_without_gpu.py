"""Every command as a newcomer types it on a machine without a GPU, as a subprocess: the exit code a script can test
(docs/exit-codes.md), what it says, never a traceback, nothing written where nobody asked."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from repro.report.results import SCHEMA
from tests.commands import ROOT, fake_vllm, no_traceback, one_line_nothing_written, run_repro


# under xdist, every test of this file runs on one worker (conftest's SHARED_FIXTURE): it runs once
@pytest.fixture(scope="module")
def matrix_here(tmp_path_factory):
    """`python -m repro matrix --json FILE` in an empty folder (the CPU model's 40 predictions, the costly part of
    this file): the process, the folder it ran in, and FILE, outside that folder. Two tests read it."""
    root = tmp_path_factory.mktemp("matrix-here")
    (root / "cwd").mkdir()
    with pytest.MonkeyPatch.context() as mp:  # a module fixture runs before conftest's per-test private cache
        mp.setenv("REPRO_CACHE_DIR", str(root / "repro-cache"))
        r = run_repro("matrix", "--json", str(root / "m.json"), cwd=root / "cwd")
    return r, root / "cwd", root / "m.json"


def test_matrix_without_gpu_writes_only_where_asked(tmp_path, matrix_here):
    r, cwd, _ = matrix_here
    no_traceback(r)
    assert r.returncode == 0 and r.stdout.startswith("No GPU here") and not any(cwd.iterdir())  # its --json only
    out = tmp_path / "out"
    r = run_repro("matrix", "--out", str(out), "--json", str(tmp_path / "m.json"), "--model-sms", "16", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert {p.name for p in out.iterdir()} >= {"verdicts.md", "results.json"}  # heatmap.png too with matplotlib
    doc = json.loads((tmp_path / "m.json").read_text())
    assert doc["source"] == "model" and doc["schema"] == SCHEMA and len(doc["cases"]) == 8


def test_matrix_gate_without_gpu_fails(tmp_path):
    r = run_repro("matrix", "--gate", "--model-sms", "16", cwd=tmp_path)
    no_traceback(r)
    assert r.returncode == 1 and "GATE FAILED" in r.stderr


def test_dry_run_lists_exactly_what_the_run_runs_here(tmp_path, matrix_here):
    dry = run_repro("matrix", "--dry-run", cwd=tmp_path)
    no_traceback(dry)
    assert dry.returncode == 0 and len(dry.stderr.strip().splitlines()) == 1, dry.stderr
    ids = dry.stdout.split()
    if "the GPU matrix" in dry.stderr:  # a GPU here: the GPU matrix is what runs
        assert dry.stderr.startswith(f"dry run: {len(ids)} cases, the GPU matrix (kernels run") and len(ids) == 48
        return
    assert dry.stderr.startswith("dry run: 40 cases, the CPU model's predictions (no GPU here;"), dry.stderr
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
    r, _, ran = matrix_here  # the run itself, in the same environment
    assert r.returncode == 0, r.stderr
    assert ids == [c["case"] for c in json.loads(ran.read_text())["cases"]]
    assert all("-eager-" in i for i in ids)  # the model predicts the eager warmups only
    gpu = run_repro("matrix", "--dry-run", "--gpu-only", cwd=tmp_path)  # the GPU matrix, listed where it cannot run
    assert gpu.returncode == 0 and len(gpu.stdout.split()) == 48 and len(gpu.stderr.strip().splitlines()) == 1
    assert "the GPU matrix (--gpu-only; no GPU here, so the run itself would exit 4)" in gpu.stderr
    model = run_repro("matrix", "--dry-run", "--model", "--sms", "full", cwd=tmp_path)
    assert model.returncode == 0 and len(model.stdout.split()) == 8
    assert model.stderr.startswith("dry run: 8 cases, the CPU model's predictions (--model;")
    bad = run_repro("matrix", "--dry-run", "--modes", "eager,graph", cwd=tmp_path)  # refused as the run refuses it
    assert bad.returncode == 2 and "eager warmups only" in bad.stderr


def test_could_not_run_here_is_exit_4_in_one_line(tmp_path):
    """Exit 4 (could not run here) at once, one line, nothing written: matrix --gpu-only, gate without a GPU (before
    any case runs) or without a vLLM build."""
    out = tmp_path / "out"
    build = fake_vllm(tmp_path / "vllm-0.25.1", compiled=True)
    before = set(tmp_path.rglob("*"))
    r = run_repro("matrix", "--gpu-only", "--out", str(out), cwd=tmp_path)
    one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: no CUDA GPU visible (--gpu-only)")
    r = run_repro("gate", "--no-installed", "--control", f"0.25.1={build}", "--out", str(out), cwd=tmp_path)
    one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: no CUDA GPU visible")
    assert "[gate]" not in r.stdout  # no case ran
    r = run_repro("gate", "--no-installed", cwd=tmp_path)
    one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: no vLLM build to test")
    assert "no CUDA GPU is visible" in r.stderr and "vllm-check" in r.stderr  # both reasons, and where to go
    wheel = tmp_path / "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    r = run_repro("gate", "--no-installed", "--vllm", f"0.25.1={wheel}", cwd=tmp_path)
    assert r.returncode == 2 and "a wheel runs installed" in r.stderr
    r = run_repro("gate", "--no-installed", "--vllm", f"0.25.1={build}/vllm", cwd=tmp_path)
    assert r.returncode == 2 and "name the folder that holds vllm/" in r.stderr
    r = run_repro("gate", "--no-installed", "--control", f"0.25.1={build}", "--dry-run", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.split()  # listing the cases needs no GPU


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is not None, reason="MPS is here: the probe would run")
def test_probe_coexistence_without_mps_is_exit_4(tmp_path):
    before = set(tmp_path.rglob("*"))
    r = subprocess.run(
        [sys.executable, "-m", "repro.run.smcontrol", "--probe-coexistence"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: nvidia-cuda-mps-control not found")
    r = subprocess.run(
        [sys.executable, "-m", "repro.run.smcontrol", "--bogus"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_vllm_check_exit_codes(tmp_path):
    r = run_repro("vllm-check", str(tmp_path))  # not a vLLM source: bad input, as for a wheel
    assert r.returncode == 2 and "not a vLLM checkout (no vllm/ package)" in r.stderr
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("")
    r = run_repro("vllm-check", str(tmp_path / "vllm"))  # the package, not the folder holding it: bad input
    assert r.returncode == 2 and f"the vllm package itself; name the folder that holds it ({tmp_path})" in r.stderr


def test_doctor_on_cpu_torch_promises_no_green_contexts_and_no_server():
    r = run_repro("doctor")
    no_traceback(r)
    green = next(ln for ln in r.stdout.splitlines() if ln.startswith("green contexts:"))
    server = next(ln for ln in r.stdout.splitlines() if ln.startswith("repro server:"))
    assert r.returncode == 0 and "not available" in green, green
    assert "of no use here" in server and "python -m repro serve" not in server, server
    here = next(ln for ln in r.stdout.splitlines() if ln.startswith("here you can run:"))
    assert all(cmd in here for cmd in ("vllm-check", "bisect", "matrix")), here
    assert next(ln for ln in r.stdout.splitlines() if ln.startswith("FA3 upstream:"))
