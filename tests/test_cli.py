"""CLI: bad input is one line and exit code 2; doctor works without a GPU; dry runs list readable ids."""

import subprocess
import sys

import pytest

from repro.cli import main


def _run(*args):
    return subprocess.run([sys.executable, "-m", "repro", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, msg",
    [
        (["run", "--backend", "nope"], "invalid choice"),
        (["run", "--backend", "vllm", "--backend-path", "/nonexistent/_vllm_fa3_C.so"], "no such file"),
        (["run", "--backend", "vllm", "--sm", "mps:0"], "positive SM count"),
        (["run", "--backend", "vllm", "--sm", "sm_margin:x"], "bad SM configuration"),
        (["run", "--backend", "vllm", "--head-dim", "100"], "head_dim"),
        (["run", "--backend", "vllm", "--poison", "banana"], "bad poison"),
        (["matrix", "--backends", "flash2"], "unknown backend"),
        (["run", "--backend", "vllm", "--scenario", "pair", "--launched", "t400r100"], "over the max batch"),
        (["run", "--backend", "vllm", "--scenario", "pair", "--launched", "tXr"], "bad descriptor"),
        (["bisect", "--vllm", "/nonexistent"], "no such file"),
        (["agree", "/nonexistent.json"], "no such file"),
        (["matrix", "--model", "--model-sms", "0,16"], "model SM counts"),
        (["matrix", "--backend", "vllm"], "takes only 'model'"),
        (["matrix", "--splits", "a,b"], "comma-separated"),
        (["matrix", "--dry-run", "--modes", ""], "matrix is empty"),
        (["matrix", "--model", "--window", "128"], "does not model a feature"),
        (["matrix", "--dry-run", "--built-for", "t8r2"], "describe the pair scenario"),
        (["matrix", "--dry-run", "--gpu-only", "--scenario", "pair", "--launched", "t400r100"], "over the max batch"),
    ],
)
def test_bad_input_one_line_exit_2(args, msg):
    r = _run(*args)
    assert r.returncode == 2, r.stderr
    assert msg in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_doctor_without_gpu_exits_0():
    r = _run("doctor")
    assert r.returncode == 0
    assert "GPU:" in r.stdout and "compute-sanitizer" in r.stdout and "FA3 vllm" in r.stdout


def test_matrix_dry_run_lists_default_ids(capsys):
    assert main(["matrix", "--dry-run", "--gpu-only"]) == 0  # the GPU matrix, GPU here or not
    ids = capsys.readouterr().out.split()
    assert len(ids) == 48 and all(i.startswith("stale_metadata-") for i in ids)
    # positive controls first
    assert ids[0].endswith("-v2-capture-stale-smmargin16-eager-splits32-h32-8x128-poison-int-max")


def test_matrix_pair_scenario_lists_its_descriptor_pair(capsys):
    assert main(["matrix", "--dry-run", "--gpu-only", "--scenario", "pair", "--built-for", "t8r2"]) == 0
    ids = capsys.readouterr().out.split()
    assert len(ids) == 48 and all("-pair-stale-" in i or "-pair-fresh-" in i for i in ids)
    assert all("-pair-t8r2-t32r8-" in i for i in ids)  # --launched left to its default


def test_run_without_gpu_is_a_skip_a_script_can_test(tmp_path, capsys):
    rc = main(["run", "--backend", "vllm", "--out", str(tmp_path), "--timeout", "60"])
    err = capsys.readouterr().err
    assert rc == 4 and err.startswith("skip:") and "matrix --model" in err
    assert not any(tmp_path.iterdir())  # nothing written for a case that did not run


def test_matrix_without_gpu_prints_the_models_predictions(capsys):
    assert main(["matrix", "--poison", "none", "--model-sms", "16,132", "--sanitizer"]) == 0
    out = capsys.readouterr().out
    row = "| stale_metadata-upstream-v2-capture-stale-smmargin16-eager-splits0-h32-8x128-memcheck | **oob** | CPU model: out-of-bounds read predicted | combine |"
    assert out.startswith("No GPU here") and row in out


def test_matrix_backend_model(capsys):
    assert main(["matrix", "--backend", "model", "--model-sms", "16"]) == 0
    assert "Backend: the CPU model." in capsys.readouterr().out
