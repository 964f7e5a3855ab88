"""Every command as a newcomer types it, on a machine without a GPU, as a subprocess: the exit code a script can test,
one line on stderr for bad input, never a traceback, nothing written where nobody asked."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
H200_RUN = ROOT / "results" / "h200-default" / "results.json"


def _repro(*args, cwd=None):
    """`python -m repro ...` of this checkout (first on PYTHONPATH), run in `cwd`: from another folder, the interpreter
    would otherwise import whichever checkout its environment installed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    return subprocess.run(
        [sys.executable, "-m", "repro", *args], capture_output=True, text=True, timeout=300, cwd=cwd or ROOT, env=env
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
    (tmp_path / "garbage.whl").write_text("not a zip archive")
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
    # issue 20, second round: tracebacks, and impossible input that was accepted
    (["matrix", "--kv-heads", "0"], "--kv-heads must be positive"),
    (["run", "--backend", "vllm", "--q-heads", "-1"], "--q-heads must be positive"),
    (["vllm-check", "@garbage.whl"], "not a wheel (not a zip archive)"),
    (["vllm-check", "@empty.json"], "neither a vLLM checkout folder nor a wheel"),
    (["matrix", "--sms", "sm_margin:200"], "impossible SM count"),
    (["matrix", "--model-sms", "200"], "model SM counts must be in 1..132"),
    (["xdist-report", "@corrupt.xml", "--workers", "-1"], "--workers must be at least 1"),
    (["run", "--backend", "vllm", "--out", "/proc/x"], "--out /proc/x: cannot create it"),
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


# ---- issue 20, second round


def _one_line_nothing_written(r, tmp_path, before, code, msg):
    _no_traceback(r)
    assert r.returncode == code, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr
    assert set(tmp_path.rglob("*")) == before


def _fake_vllm(prefix: Path, compiled: bool) -> Path:
    """A folder holding a `vllm` package; with a compiled extension it looks like a real (GPU) build."""
    (prefix / "vllm").mkdir(parents=True)
    (prefix / "vllm" / "__init__.py").write_text('__version__ = "0.25.1"\n')
    if compiled:
        (prefix / "vllm" / "_C.abi3.so").write_bytes(b"\x7fELF")
    return prefix


def test_could_not_run_here_is_exit_4_in_one_line(tmp_path):
    """Exit 4 (could not run here) at once, one line, nothing written: matrix --gpu-only, gate without a GPU (before
    any case runs) or without a vLLM build."""
    out = tmp_path / "out"
    build = _fake_vllm(tmp_path / "vllm-0.25.1", compiled=True)
    before = set(tmp_path.rglob("*"))
    r = _repro("matrix", "--gpu-only", "--out", str(out), cwd=tmp_path)
    _one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: no CUDA GPU visible (--gpu-only)")
    r = _repro("gate", "--no-installed", "--control", f"0.25.1={build}", "--out", str(out), cwd=tmp_path)
    _one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: no CUDA GPU visible")
    assert "[gate]" not in r.stdout  # no case ran
    r = _repro("gate", "--no-installed", cwd=tmp_path)
    _one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: no vLLM build to test")
    r = _repro("gate", "--no-installed", "--control", f"0.25.1={build}", "--dry-run", cwd=tmp_path)
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
    _one_line_nothing_written(r, tmp_path, before, 4, "cannot run here: nvidia-cuda-mps-control not found")
    r = subprocess.run(
        [sys.executable, "-m", "repro.run.smcontrol", "--bogus"], capture_output=True, text=True, cwd=ROOT
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_bisect_on_a_repo_without_vllm_is_bad_input_at_once(tmp_path):
    repo = tmp_path / "not-vllm"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "x.py").write_text("")
    for cmd in (["init", "-q"], ["add", "."], ["-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "x"]):
        subprocess.run(["git", "-C", str(repo), *cmd], check=True, capture_output=True)
    r = _repro("bisect", "--vllm", str(repo), "--good", "HEAD", "--bad", "HEAD")
    _no_traceback(r)
    assert r.returncode == 2 and "not a vLLM checkout (no vllm/ package at --bad HEAD)" in r.stderr
    assert "bisect" not in subprocess.run(["git", "-C", str(repo), "status"], capture_output=True, text=True).stdout
    r = _repro("bisect", "--vllm", str(repo), "--good", "HEAD", "--status")
    assert r.returncode == 125 and "untestable" in r.stdout


def build_parser_commands():
    from repro.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    return sub.choices


def test_mps_daemon_writes_nothing_until_started_and_removes_its_folder(tmp_path, monkeypatch):
    from repro.errors import Unavailable
    from repro.run.smcontrol import MpsDaemon

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no nvidia-cuda-mps-control
    d = MpsDaemon()
    assert not any(tmp_path.iterdir()) and d.env == {}
    with pytest.raises(Unavailable):
        d.start()
    d.stop()
    assert not any(tmp_path.iterdir())
    (tmp_path / "bin").mkdir()
    fail = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fail.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 1\n")
    fail.chmod(0o755)
    with pytest.raises(Unavailable, match="did not start: cannot start"), MpsDaemon():
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]  # the failed start removed its folder


def test_serve_on_cpu_says_it_is_of_no_use_and_stop_leaves_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "REPRO_SERVER"}
    env["XDG_RUNTIME_DIR"] = str(tmp_path)  # the default socket folder: tmp_path/repro-<uid>/
    run = lambda *a: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "repro", "serve", *a], capture_output=True, text=True, timeout=180, cwd=ROOT, env=env
    )
    r = run("--idle", "60")
    try:
        _no_traceback(r)
        assert r.returncode == 0 and "repro server at" in r.stdout, r.stderr
        assert r.stderr.startswith("note: no CUDA GPU here") and "of no use" in r.stderr
        assert len(list((tmp_path / f"repro-{os.getuid()}").glob("server-*.log"))) == 1
    finally:
        r = run("--stop")
    assert r.returncode == 0 and "stopped the repro server" in r.stdout
    assert not any(tmp_path.iterdir())  # no socket, no server.log, no repro-<uid>/


def test_doctor_on_cpu_torch_promises_no_green_contexts_and_no_server():
    r = _repro("doctor")
    _no_traceback(r)
    green = next(ln for ln in r.stdout.splitlines() if ln.startswith("green contexts:"))
    server = next(ln for ln in r.stdout.splitlines() if ln.startswith("repro server:"))
    assert r.returncode == 0 and "not available" in green, green
    assert "of no use here" in server and "python -m repro serve" not in server, server


def test_heatmap_of_a_prediction_says_so(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.axes import Axes

    from repro.case.matrix import MatrixRun
    from repro.case.spec import CaseResult, CaseSpec
    from repro.report import results as report

    titles = []
    monkeypatch.setattr(Axes, "set_title", lambda self, t, *a, **k: titles.append(t))
    results = [(CaseSpec("vllm", "stale"), CaseResult("c", "clean", ""))]
    assert report.heatmap(MatrixRun(results, 0.1, None, source=report.MODEL), tmp_path / "m.png")
    assert report.heatmap(MatrixRun(results, 0.1, None, source=report.GPU), tmp_path / "g.png")
    assert titles[0].startswith("predicted by the CPU model (no kernels ran)")
    assert "predicted" not in titles[1]


def test_version():
    r = _repro("--version")
    assert r.returncode == 0 and r.stdout.startswith("python -m repro ") and not r.stderr


def test_every_option_and_positional_has_help_and_shows_its_default():
    import argparse

    for name, sub in build_parser_commands().items():
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            what = f"{name} {'/'.join(action.option_strings) or action.dest}"
            assert action.help, f"{what}: no help"
            trivial = action.default in (None, False, [], argparse.SUPPRESS)
            assert trivial or "default" in action.help, f"{what}: default {action.default!r} not shown"
        r = _repro(name, "--help")
        assert r.returncode == 0 and not r.stderr, name


# ---- issue 20 item 11: summaries of the records are generated from them, and a stale one fails here

RESULTS = ROOT / "results"
REGENERATE = "python -m repro agree results/*/results.json --out results/model-agreement.md"


def test_model_agreement_summary_is_what_agree_writes_now(monkeypatch):
    from repro.fa3_model.agreement import compare, markdown
    from repro.report.redact import redact
    from repro.report.results import MODEL, is_vllm_gate_record, load_json

    monkeypatch.chdir(ROOT)  # the summary names its sources as results/...
    paths = sorted(str(p.relative_to(ROOT)) for p in RESULTS.glob("*/results.json"))
    paths = [p for p in paths if not is_vllm_gate_record(ROOT / p)]  # `agree` leaves real-vLLM gate records out too
    measured = [p for p in paths if load_json(p).source != MODEL]
    assert len(measured) >= 17
    text = (RESULTS / "model-agreement.md").read_text()
    assert redact(markdown(compare(measured), measured)) == text, f"results/model-agreement.md is stale: {REGENERATE}"
    numbers = re.search(
        r"Verdicts agree in (\d+) of (\d+) cases; the faulting kernel agrees in (\d+) of (\d+) .*? "
        r"Descriptors agree in (\d+) of (\d+) cases",
        text,
    )
    quoted = (
        "{} of {} verdicts agree; the faulting kernel agrees in {} of {} memcheck cases; "
        "descriptors agree in {} of {} cases where the GPU named one"
    ).format(*numbers.groups())
    assert quoted in (RESULTS / "README.md").read_text(), f"results/README.md should say: {quoted}"


@pytest.mark.parametrize("folder, poison", [("model-int-max", "int-max"), ("model-nopoison", "none")])
def test_shipped_predictions_are_what_matrix_model_predicts_now(tmp_path, folder, poison):
    from repro.report.results import MODEL, load_json

    shipped = load_json(RESULTS / folder / "results.json")
    r = _repro("matrix", "--model", "--poison", poison, "--json", str(tmp_path / "now.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    now = load_json(tmp_path / "now.json")

    def verdicts(run):
        return {s.case_id: (r.verdict, r.kernel, r.descriptor) for s, r in run.results}

    assert shipped.source == now.source == MODEL
    assert verdicts(shipped) == verdicts(now), (
        f"results/{folder} is stale: python -m repro matrix --model --poison {poison} --out results/{folder}"
    )


def test_xdist_summary_quotes_the_junit_suite_times():
    from repro.report.xdist import check_junit

    one, two = (check_junit(RESULTS / "h200x2-xdist" / f"junit-n{n}.xml").suite_seconds for n in (1, 2))
    quoted = f"16 cases in {two:.1f} s on 2 GPUs vs {one:.1f} s on 1 ({two / one:.2f}x"
    readme = (RESULTS / "README.md").read_text()
    assert quoted in readme, quoted
    assert f"took {two:.1f} s against {one:.1f} s for 16 on one worker" in readme
    for n, seconds in ((1, one), (2, two)):
        assert f"Suite time {seconds:.1f} s." in (RESULTS / "h200x2-xdist" / f"xdist-n{n}.md").read_text()


# ---- issue 20 item 6: --dry-run lists what the command would run here


def test_dry_run_lists_exactly_what_the_run_runs_here(tmp_path):
    dry = _repro("matrix", "--dry-run", cwd=tmp_path)
    _no_traceback(dry)
    assert dry.returncode == 0 and len(dry.stderr.strip().splitlines()) == 1, dry.stderr
    ids = dry.stdout.split()
    if "the GPU matrix" in dry.stderr:  # a GPU here: the GPU matrix is what runs
        assert dry.stderr.startswith(f"dry run: {len(ids)} cases, the GPU matrix (kernels run") and len(ids) == 48
        return
    assert dry.stderr.startswith("dry run: 40 cases, the CPU model's predictions (no GPU here;"), dry.stderr
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
    r = _repro("matrix", "--json", str(tmp_path / "m.json"), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert ids == [c["case"] for c in json.loads((tmp_path / "m.json").read_text())["cases"]]
    assert all("-eager-" in i for i in ids)  # the model predicts the eager warmups only
    gpu = _repro("matrix", "--dry-run", "--gpu-only", cwd=tmp_path)  # the GPU matrix, listed where it cannot run
    assert gpu.returncode == 0 and len(gpu.stdout.split()) == 48 and len(gpu.stderr.strip().splitlines()) == 1
    assert "the GPU matrix (--gpu-only; no GPU here, so the run itself would exit 4)" in gpu.stderr
    model = _repro("matrix", "--dry-run", "--model", "--sms", "full", cwd=tmp_path)
    assert model.returncode == 0 and len(model.stdout.split()) == 8
    assert model.stderr.startswith("dry run: 8 cases, the CPU model's predictions (--model;")
    bad = _repro("matrix", "--dry-run", "--modes", "eager,graph", cwd=tmp_path)  # refused as the run refuses it
    assert bad.returncode == 2 and "eager warmups only" in bad.stderr


# ---- issue 20 item 9: the verdict table explains itself to a newcomer


def test_predicted_table_names_its_columns_and_says_what_a_prediction_is(tmp_path):
    r = _repro("matrix", "--model-sms", "16", "--json", str(tmp_path / "m.json"), cwd=tmp_path)
    _no_traceback(r)
    assert r.returncode == 0, r.stderr
    header = next(ln for ln in r.stdout.splitlines() if ln.startswith("| case |"))
    assert "| met? |" in header and "| |" not in header
    cases = json.loads((tmp_path / "m.json").read_text())["cases"]
    stale = [c for c in cases if c["strategy"] == "stale"]
    fresh = [c for c in cases if c["strategy"] == "fresh"]
    assert len(stale) == len(fresh) == 4
    for c in stale:  # what the model knows: the entries that differ from a fresh build
        assert c["verdict"] == "oob" and c["evidence"] == "CPU model: out-of-bounds read predicted"
        assert c["stale_fields"] and "scheduler_metadata.num_splits_dynamic" in c["stale_fields"]
        assert f"| {c['case']} | **oob** | CPU model: out-of-bounds read predicted |" in r.stdout
        assert re.search(rf"\| {re.escape(c['case'])} \|.*\| ok \| [^|]*md\.num_splits_dynamic:\d+", r.stdout)
    for c in fresh:
        assert c["verdict"] == "clean" and c["stale_fields"] == {}
        assert "no pass" not in c["reason"] and "fresh strategy builds metadata for every pass" in c["reason"]
        assert c["evidence"] == "CPU model: clean run predicted"
    legend = r.stdout.split("What the columns mean:", 1)[1].split("Reasons:", 1)[0]
    assert "**met?**" in legend and "**stale fields**" in legend
    assert "so no pass runs on stale metadata" in legend
    assert "prediction of the CPU model" in legend and "compute-sanitizer memcheck finding" in legend
    assert "Why `main` and not the split-KV combine kernel" in legend
    assert "not attributed" not in legend  # the model names a kernel: no crash row to explain


def test_gpu_table_says_why_a_crash_names_no_kernel():
    from repro.report import results as report

    run = report.load_json(H200_RUN)  # a GPU run without --sanitizer: its crashes name no kernel
    md = report.markdown(run)
    assert "| not attributed |" in md
    legend = md.split("What the columns mean:", 1)[1].split("Reasons:", 1)[0]
    line = next(ln for ln in legend.splitlines() if "not attributed" in ln)
    assert "faulting line" in line and "--sanitizer" in line and "CUDA_LAUNCH_BLOCKING=1 rerun" in line
    assert "prediction of the CPU model" not in legend


def test_agree_reports_verdict_and_descriptor_agreement_apart():
    from repro.fa3_model.agreement import Agreement, counts, markdown

    rows = [
        Agreement("a", "crash", None, "t48r12", "oob", "main", "t64r16", ("oob",)),  # one verdict, two passes
        Agreement("b", "oob", "combine", "t64r16", "oob", "combine", "t64r16", ("oob",)),
        Agreement("c", "clean", None, None, "clean", None, None, ("clean",)),  # a clean run names no pass
    ]
    assert counts(rows) == {"verdict": (3, 3), "descriptor": (1, 2), "kernel": (1, 1)}
    md = markdown(rows, ["x.json"])
    assert "Verdicts agree in 3 of 3 cases" in md and "Descriptors agree in 1 of 2 cases where the GPU named one" in md
    assert "| a | crash | - | t48r12 | oob | oob | main | t64r16 | yes | NO | - |" in md
