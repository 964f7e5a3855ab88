"""A demanding new user's sixth round (branch rev54), each guarantee a test: a duration no wait can take is refused
before any work; the pytest tier's variables are judged, by name, before any case runs; an option that would be
ignored or contradicts another is refused (run's pair descriptors, matrix --model --gpu-only, gate --installed-label
with --no-installed, a value given twice); a check with nothing to check is no answer (xdist-report); a damaged
results/index.json is named as itself; bisect answers within its range and never names a commit no check judged bad;
plugin-request and gate --devices refuse what no GPU has; redact and --gate-report write whole, never over another
kind of file; a gate run without a GPU says so under its headline; Ctrl-C in python -m repro's imports exits 130; bench,
agree and records --speed take each record for what it is, once."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.commands import ROOT, fake_vllm, isolated_env, main_in, one_commit, refused_in

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


# 2. the pytest tier's variables: judged at collection, each error naming its variable.


@pytest.mark.parametrize(
    "var,value",
    [
        ("REPRO_GATE_TIMEOUT", "abc"),
        ("REPRO_GATE_TIMEOUT", "1e12"),
        ("REPRO_GATE_TIMEOUT", "nan"),
        ("REPRO_SELF_CONTROL", "under_test"),
        ("REPRO_GATE_MODES", "sm_margin:0"),
        ("REPRO_GATE_METHODS", "eagle,eagle"),
    ],
)
def test_the_pytest_tiers_variables_are_judged_by_name_before_any_case_runs(tmp_path, var, value):
    # REPRO_GATE_TIMEOUT and REPRO_SELF_CONTROL were read only inside a running test: on a CPU the test skipped over
    # them, on a GPU every test failed with a traceback (or, for a timeout past 24.8 days, an OverflowError mid-run)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "cases/test_vllm_gate.py", "-m", "vllm"]
    env = isolated_env(tmp_path, **{var: value})
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 2, r.stdout[-2000:]
    assert f"ConfigError: {var}={value!r}" in r.stdout, r.stdout[-2000:]


def test_the_pytest_tiers_settings_read_as_the_gate_reads_them():
    from cases.test_vllm_gate import settings
    from repro.vllm_integration.gate.methods import ALL

    got = settings({"REPRO_GATE_TIMEOUT": "60", "REPRO_SELF_CONTROL": "none"})
    assert got["timeout"] == 60.0 and got["self_control"] == "none"
    assert [m.name for m in got["modes"]] == ["audit", "plain"] and got["methods"] == ALL  # every method by default
    assert settings({"REPRO_GATE_METHODS": "eagle"})["methods"] == ("eagle",)


# 3. an option that would be ignored is refused: `run` as `matrix` does.


@pytest.mark.parametrize("scenario", ["v2-capture", "spec-decode"])
def test_run_refuses_the_pair_scenarios_descriptors_for_another_scenario_as_matrix_does(tmp_path, scenario):
    # run --built-for t4r1 (no --scenario pair) ran, or on a CPU said "no GPU", the v2-capture case: never the pair asked for
    for flag in ("--built-for", "--launched"):
        args = ["run", "--backend", "vllm", "--scenario", scenario, flag, "t4r1"]
        refused_in(args, tmp_path, 2, f"describe the pair scenario, not --scenario {scenario}")
        refused_in(["matrix", "--dry-run", "--scenario", scenario, flag, "t4r1"], tmp_path, 2, "describe the pair")


def test_matrix_refuses_gpu_only_with_the_cpu_model_rather_than_predicting(tmp_path):
    # matrix --model --gpu-only printed the CPU model's table and exited 0: --gpu-only says "fail instead of predicting"
    for model in (["--model"], ["--backend", "model"]):
        for extra in (["--dry-run"], ["--out", "m"]):
            refused_in(["matrix", *model, "--gpu-only", *extra], tmp_path, 2, "--gpu-only refuses the CPU model")


# 4. a check that had nothing to check is no answer, never a failed (or passed) check.


def test_xdist_report_of_a_run_where_no_case_recorded_its_gpu_is_no_answer(tmp_path):
    # it printed a report of an empty table with PROBLEMS and exited 1, "a worker shared or changed GPUs"
    junit = tmp_path / "j.xml"
    junit.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="1">'
        '<testcase classname="a" name="t1" time="0.1"><skipped message="no CUDA GPU"/></testcase>'
        "</testsuite></testsuites>"
    )
    r = refused_in(["xdist-report", str(junit), "--out", str(tmp_path / "x.md")], tmp_path, 2, "nothing to check")
    assert not r.stdout


def test_the_exit_code_table_says_what_xdist_report_answers_with_nothing_to_check():
    from repro.exit_codes import EXIT_CODES

    assert "no case recorded its GPU" in EXIT_CODES["xdist-report"][2]
    assert "no case recorded its GPU" in (ROOT / "docs" / "exit-codes.md").read_text()


# 5. a damaged results/index.json is named as what it is, before anything is packed or written, in every reader.


@pytest.mark.parametrize(
    "damage", [b"\xff", b"", b"[]", b'{"records": [{"nam": 1}]}'], ids=["utf8", "empty", "list", "key"]
)
def test_a_damaged_index_is_named_before_anything_is_packed_and_stale_says_so_without_a_traceback(tmp_path, damage):
    import shutil

    root = tmp_path / "co"
    (root / "results" / "x").mkdir(parents=True)
    (root / "results" / "x" / "results.json").write_text('{"kind": "vllm-gate", "outcome": "PASS"}')
    (root / "results" / "index.json").write_bytes(damage)
    shutil.copy(ROOT / "README.md", root / "README.md")
    git = ["git", "-C", str(root), "-c", "user.email=a@b", "-c", "user.name=a"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "README.md"], check=True)
    subprocess.run([*git, "commit", "-qm", "readme"], check=True)
    # --add and --index said "a record in git history cannot be read"; --stale ended in a UnicodeDecodeError traceback
    for args in (["--add", "x"], ["--index"], ["--stale"]):
        refused_in(["records", "--root", str(root), *args], tmp_path, 2, "results/index.json cannot be read")
    assert (root / "results" / "index.json").read_bytes() == damage and not list(root.rglob("*.tar.xz"))


# 6. bisect answers within the range it was given.


def test_a_bisect_of_adjacent_good_and_bad_names_bad_and_says_no_check_ran_never_a_commit_outside_the_range(tmp_path):
    from tests.fake_vllm import MANAGER_BAD, MANAGER_GOOD, write_manager_history

    history = [MANAGER_GOOD + "\n# 0\n", MANAGER_BAD, MANAGER_BAD + "\n#\n", MANAGER_GOOD + "\n# fixed\n"]
    shas = write_manager_history(tmp_path / "repo", history)
    # git bisect start named --bad at once; the `git bisect run` after it judged the checkout's HEAD instead (here the
    # fixed change 3: "bisect found no first bad commit"; with a bad HEAD, a commit past --bad)
    r = main_in(["bisect", "--vllm", "repo", "--good", "HEAD~3", "--bad", "HEAD~2"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert f"first bad commit: {shas[1]} change 1" in r.stdout, r.stdout
    assert "no commit lies between --good HEAD~3 and --bad HEAD~2: git named --bad, no check ran" in r.stdout
    head = subprocess.run(["git", "-C", str(tmp_path / "repo"), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head.stdout.strip() == shas[3]  # the checkout given back as it was


def test_a_source_bisect_whose_good_or_bad_the_source_check_contradicts_names_no_commit_never_judged_bad(tmp_path):
    from tests.fake_vllm import MANAGER_BAD, MANAGER_GOOD, write_manager_history

    shas = write_manager_history(
        tmp_path / "repo", [MANAGER_GOOD + "\n# 0\n", MANAGER_GOOD + "\n# 1\n", MANAGER_BAD, MANAGER_BAD + "\n#\n"]
    )
    # git takes --good and --bad on trust: it said "first bad commit: change 1" (--bad itself, judged good by its one
    # step's neighbour and never judged bad) and "change 3" (after a --good that was bad already), each exit 0
    for good, bad, why in (
        ("HEAD~4", "HEAD~2", "--bad HEAD~2 shows no known bad pattern in its source"),
        ("HEAD~1", "HEAD", "--good HEAD~1 shows the bad pattern already in its source"),
    ):
        r = main_in(["bisect", "--vllm", "repo", "--good", good, "--bad", bad], tmp_path)
        assert r.returncode == 1 and "first bad commit" not in r.stdout, (r.returncode, r.stdout)
        assert r.stderr.startswith(f"bisect found no first bad commit: {why}"), r.stderr
    head = subprocess.run(["git", "-C", str(tmp_path / "repo"), "rev-parse", "HEAD"], capture_output=True, text=True)
    assert head.stdout.strip() == shas[3]


# 7. plugin-request: an SM margin no GPU has is refused, as the gate's sm_margin:N is.


def test_plugin_request_refuses_an_sm_margin_no_gpu_has_as_the_gate_does(tmp_path):
    # it printed a request whose margin leaves FA3 fewer than 0 SMs to plan for, exit 0
    refused_in(["plugin-request", "--sm-margin", "100000"], tmp_path, 2, "--sm-margin 100000: impossible SM count")
    refused_in(["gate", "--dry-run", "--modes", "sm_margin:100000"], tmp_path, 2, "impossible SM count: 0 to 1024")
    r = main_in(["plugin-request", "--sm-margin", "66"], tmp_path)
    assert r.returncode == 0 and '"sm_margin": 66' in r.stdout


# 8. redact rewrites each record whole or not at all.


def test_a_redact_that_cannot_write_a_record_whole_leaves_it_as_it_was(tmp_path):
    # a full disk (here: a file-size limit of 4 KiB) while redact rewrote a record in place left the record cut at the
    # limit, its end lost; now each record is written beside itself and renamed into place
    record = tmp_path / "r.json"
    record.write_text("".join(f'{{"log": "/home/someone/work/case-{i}/out.txt"}}\n' for i in range(400)))
    before = record.read_bytes()
    code = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)); from repro.cli import main; "
        f"sys.exit(main(['redact', {str(record)!r}]))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=isolated_env(tmp_path))
    assert r.returncode == 2 and "cannot write it" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert record.read_bytes() == before and len(before) > 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "tmp"]  # no temporary file left
    assert main_in(["redact", str(record)], tmp_path).returncode == 0 and "<path>/out.txt" in record.read_text()


# 9. pytest --gate-report: only an earlier gate report is replaced.


def _gate_tier(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """The GPU tier through its stand-ins (tests/standin_gpu_tier.py), as tests/test_gpu_tier_under_xdist.py runs it."""
    cmd = [sys.executable, "-m", "pytest", "cases", "-m", "gpu", "-k", "stale_metadata", "--gate", "-q"]
    cmd += ["-p", "tests.standin_gpu_tier", "-p", "no:cacheprovider", *args]
    env = isolated_env(tmp_path, REPRO_EXECUTOR="process", REPRO_LOG_DIR=str(tmp_path / "logs"))
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_a_gate_report_folder_holding_files_of_another_kind_is_refused_before_the_run_and_kept(tmp_path):
    # gate.json and gate.md were written over at the end of the run, whatever they were
    out = tmp_path / "out"
    out.mkdir()
    for name, text in (("gate.json", '{"my": "settings"}'), ("gate.md", "# my notes\n")):
        (out / name).write_text(text)
        r = _gate_tier(tmp_path, f"--gate-report={out}")
        assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
        assert r.stderr.strip() == f"repro: error: --gate-report {out}: its {name} is not a gate report: give another " \
            "folder (it is kept)"  # fmt: skip
        assert (out / name).read_text() == text
        (out / name).unlink()
    r = _gate_tier(tmp_path, f"--gate-report={out}")  # an earlier gate report is replaced, run after run
    assert (out / "gate.json").exists() and (out / "gate.md").exists(), r.stdout[-2000:]
    first = json.loads((out / "gate.json").read_text())
    r = _gate_tier(tmp_path, f"--gate-report={out}")
    assert r.returncode == 0 and json.loads((out / "gate.json").read_text())["outcome"] == first["outcome"]
    assert sorted(p.name for p in out.iterdir()) == ["gate.json", "gate.md"]  # no temporary file left


# 10. gate --devices: a device that is not here is refused, never handed to the cases.


def test_gate_devices_refuses_a_device_nvml_does_not_know_or_a_negative_index(tmp_path):
    from repro.errors import ConfigError
    from repro.run.smcontrol import GpuInfo, MigSlice
    from repro.vllm_integration.gate.placement import gate_devices

    def one_gpu():
        return [GpuInfo(0, "NVIDIA H200", "GPU-0", 132, False)]

    def mig_runner():
        return [GpuInfo(0, "NVIDIA H200", "GPU-0", 132, True, (MigSlice(0, 0, "MIG-a0", "1g.18gb", 16, 16000),))]

    # `--devices 1` on a one-GPU machine, or -1, went to the cases as CUDA_VISIBLE_DEVICES: no GPU in any of them
    for bad in ("1", "-1", "GPU-7", "0,MIG-zz"):
        with pytest.raises(ConfigError, match="no such device here"):
            gate_devices(bad, one_gpu)
    assert [(d.dev, d.kind) for d in gate_devices("0,GPU-0", one_gpu)] == [("0", "gpu"), ("GPU-0", "gpu")]
    assert [d.dev for d in gate_devices("MIG-a0,0", mig_runner)] == ["MIG-a0", "0"]  # a MIG GPU's own index too
    refused_in(["gate", "--dry-run", "--devices", "-1"], tmp_path, 2, "--devices -1: no such device here")


# 11. a gate that ran without a GPU (stand-in builds) says so beside its headline, in every report.


def test_a_gate_run_without_a_gpu_says_under_its_headline_that_it_vouches_for_no_real_vllm(tmp_path):
    from tests.fake_vllm import write_fake_vllm

    build = write_fake_vllm(tmp_path / "good", "0.26.0", "good")
    # only stderr said it: verdicts.md and results.json read "Gate: PASS" with nothing beside it
    r = main_in(["gate", "--no-installed", "--vllm", f"good={build}", "--out", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    said = (
        "**No GPU: these builds have no compiled extensions (stand-ins?); their answer says nothing about a real vLLM**"
    )
    md = (tmp_path / "out" / "verdicts.md").read_text()
    assert "**Gate: PASS** (" in md and md.split("**Gate: PASS**", 1)[1].split("\n\n")[1] == said
    assert r.stdout.split("**Gate: PASS**", 1)[1].split("\n\n")[1] == said
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["outcome"] == "PASS" and "says nothing about a real vLLM" in doc["environment"]["no_gpu"]


def test_gate_refuses_an_installed_label_with_no_installed_rather_than_ignore_it(tmp_path):
    build = fake_vllm(tmp_path / "b", compiled=True)
    # the label was taken and dropped: the run listed and ran only x's cases, the label named nothing
    args = ["gate", "--dry-run", "--no-installed", "--installed-label", "mine", "--vllm", f"x={build}"]
    refused_in(args, tmp_path, 2, "--installed-label names the installed vllm's cases, which --no-installed leaves out")


# 12. Ctrl-C before the command starts (in python -m repro's imports) is an interruption, exit 130, no traceback.


def test_ctrl_c_while_python_m_repro_imports_exits_130_in_one_line(tmp_path):
    code = (
        "import builtins, os, runpy, signal, sys\n"
        "real = builtins.__import__\n"
        "def imp(name, *a, **k):\n"
        "    if name == 'repro.cli':\n"
        "        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C now: Python raises it inside this import\n"
        "    return real(name, *a, **k)\n"
        "builtins.__import__ = imp\n"
        "sys.argv = ['repro', 'doctor']\n"
        "runpy.run_module('repro', run_name='__main__', alter_sys=True)\n"
    )
    # it died by SIGINT (-2) with a KeyboardInterrupt traceback
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=isolated_env(tmp_path))
    assert r.returncode == 130 and r.stderr == "repro: interrupted\n", (r.returncode, r.stderr[-2000:])


def test_a_capture_size_given_twice_is_refused_as_every_axis_value_given_twice_is(tmp_path):
    # --capture-sizes 4,4 made a case (id ...-cap4_4-...) whose capture ran one size twice, which vLLM never does
    refused_in(["matrix", "--dry-run", "--capture-sizes", "4,4"], tmp_path, 2, "--capture-sizes: 4 given twice")
    refused_in(["run", "--backend", "vllm", "--capture-sizes", "8,4,8"], tmp_path, 2, "--capture-sizes: 8 given twice")


# 13. bench: each record is what its place in the table says it is.


def test_bench_refuses_a_plain_run_as_the_memcheck_run_and_one_record_as_both_paths(tmp_path):
    r = main_in(["matrix", "--model", "--quiet", "--splits", "32", "--out", str(tmp_path / "model")], tmp_path)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "model" / "results.json").read_text())
    doc["source"] = "gpu"  # as a GPU run of the matrix without --sanitizer records it
    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps(doc))
    # "Plain: X; memcheck: X" and a sanitizer overhead of 0 s; the paths table said old ran "process" and new
    # "forkserver", one record read twice
    refused_in(["bench", str(plain), str(plain)], tmp_path, 2, "did not run under compute-sanitizer")
    refused_in(["bench", "--paths", str(plain), str(plain)], tmp_path, 2, "one record twice")


def test_agree_and_records_speed_refuse_one_record_named_twice_rather_than_count_its_cases_twice(tmp_path):
    r = main_in(["matrix", "--model", "--quiet", "--splits", "32", "--out", str(tmp_path / "model")], tmp_path)
    doc = json.loads((tmp_path / "model" / "results.json").read_text())
    doc["source"] = "gpu"
    (tmp_path / "gpu.json").write_text(json.dumps(doc))
    # "Verdicts agree in 42 of 42 cases" for a record of 21
    refused_in(["agree", "gpu.json", "./gpu.json"], tmp_path, 2, "gpu.json and ./gpu.json are one record")
    r = main_in(
        ["records", "--root", str(ROOT), "--speed", "h200-readme-gate-12-cold", "h200-readme-gate-12-cold"], tmp_path
    )
    assert r.returncode == 2 and "are one record" in r.stderr and not r.stdout, r.stderr


# 18. (after the round, from its list of what it found) options that would be ignored, a file named as a folder, an
# idle time no server can answer in, an empty file name: each refused in one line, nothing written.


@pytest.mark.parametrize(
    "extra,msg",
    [
        (["--good", "HEAD~3"], "--good would be ignored"),
        (["--bad", "HEAD", "--overlay", "x"], "--bad, --overlay would be ignored"),
        (["--check", "gate"], "--check gate would be ignored"),
    ],
    ids=["good", "bad-overlay", "check-gate"],
)
def test_bisect_status_refuses_the_options_it_would_ignore(tmp_path, extra, msg):
    repo = one_commit(tmp_path / "vllm-src", "vllm/__init__.py")
    refused_in(["bisect", "--vllm", str(repo), "--status", *extra], tmp_path, 2, msg)


def test_a_bisect_overlay_that_is_a_file_is_named_as_no_folder(tmp_path):
    repo = one_commit(tmp_path / "vllm-src", "vllm/__init__.py")
    (tmp_path / "a-file").write_text("")
    refused_in(["bisect", "--vllm", str(repo), "--overlay", str(tmp_path / "a-file")], tmp_path, 2, "is not a folder")


def test_serve_refuses_an_idle_time_no_server_can_answer_in(tmp_path):
    refused_in(["serve", "--idle", "0.001"], tmp_path, 2, "--idle must be at least 1 s")


def test_plugin_request_refuses_an_empty_audit_file_name(tmp_path):
    refused_in(["plugin-request", "--audit-file", ""], tmp_path, 2, "--audit-file: an empty name")
