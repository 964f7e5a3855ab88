"""Bad input as a newcomer types it, on a machine without a GPU: one line on stderr with the exit code
docs/exit-codes.md gives (2 bad input, 4 could not run here), no traceback, and nothing written: not in the folder it
runs in, not in the temp folder (TMPDIR points into tmp_path). Most commands run through repro.cli.main in this process
(tests/commands.py main_in: the same cwd, environment and temp folder a subprocess gets); a few run as real
subprocesses, proving the `python -m repro` path says the same (and those that could take the machine's memory run
apart from it)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import zipfile

import pytest

from tests.commands import (
    ROOT,
    fake_vllm,
    main_in,
    no_traceback,
    one_commit,
    refused,
    refused_in,
    repro_cmd,
    run_repro,
    tree,
)


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
    (["gate", "--keep-forkserver", "60", "--launcher", "spawn"], "give --launcher fork"),
    # tracebacks, and impossible input that was accepted
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
    refused_in(args, files, 2, msg)  # no partial report, no ./results/latest, nothing in the temp folder


AS_PROCESSES = [BAD[0], BAD[11], BAD[22]]  # argparse's refusal, a file read and refused, a build looked for


@pytest.mark.parametrize("args, msg", AS_PROCESSES, ids=[" ".join(a)[:60] for a, _ in AS_PROCESSES])
def test_bad_input_is_one_line_exit_2_nothing_written_as_a_subprocess(files, args, msg):
    """The same refusals from `python -m repro` itself: the interpreter's exit code, its stderr, nothing written."""
    args = [str(files / a[1:]) if a.startswith("@") else a for a in args]
    before = set(files.rglob("*"))
    r = run_repro(*args, cwd=files)
    no_traceback(r)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and msg in r.stderr, r.stderr
    assert set(files.rglob("*")) == before  # no partial report, no ./results/latest


def test_bisect_names_a_revision_git_does_not_know(tmp_path):
    repo = one_commit(tmp_path / "vllm-src", "vllm/__init__.py")
    r = main_in(["bisect", "--vllm", str(repo), "--good", "nosuchtag"], tmp_path)
    assert r.returncode == 2 and "--good nosuchtag: git knows no such commit" in r.stderr


def test_bisect_on_a_repo_without_vllm_is_bad_input_at_once(tmp_path):
    repo = one_commit(tmp_path / "not-vllm", "src/x.py")
    r = main_in(["bisect", "--vllm", str(repo), "--good", "HEAD", "--bad", "HEAD"], tmp_path)
    assert r.returncode == 2 and "not a vLLM checkout (no vllm/ package at --bad HEAD)" in r.stderr
    assert "bisect" not in subprocess.run(["git", "-C", str(repo), "status"], capture_output=True, text=True).stdout
    r = main_in(["bisect", "--vllm", str(repo), "--status"], tmp_path)  # "not a vLLM source": 2 everywhere
    assert r.returncode == 2 and "not a vLLM checkout" in r.stderr


@pytest.mark.parametrize(
    "args",
    [
        ("matrix", "--max-model-len", "99999999999"),
        ("matrix", "--model", "--max-num-seqs", "99999999999"),
        ("matrix", "--capture-sizes", "1,99999999999"),
        ("matrix", "--q-heads", "99999999999", "--kv-heads", "1"),
        ("matrix", "--page-size", "99999999999984"),
        ("run", "--backend", "vllm", "--max-model-len", "99999999999"),
    ],
    ids=lambda a: " ".join(a),
)
def test_impossible_sizes_are_refused_before_allocating(tmp_path, args):
    t0 = time.time()
    refused(repro_cmd(*args), tmp_path, 2, "GB of GPU memory", timeout=120)
    assert time.time() - t0 < 60  # refused, not an allocation that took the machine's memory


@pytest.mark.parametrize(
    "args",
    [("matrix", "--model", "--json", "X", "--out", "X"), ("run", "--backend", "vllm", "--json", "./X", "--out", "X/")],
    ids=lambda a: " ".join(a),
)
def test_json_and_out_on_one_path_are_refused(tmp_path, args):
    refused_in(list(args), tmp_path, 2, "are one path: --json takes a file, --out a folder")


@pytest.mark.parametrize(
    "sock, msg",
    [
        ("/proc/x/s.sock", "the socket's folder /proc/x does not exist"),
        ("@" + "a" * 120 + "/s.sock", "bytes long, over the 107 a Unix socket's path may hold"),
        ("@notes.txt", "notes.txt exists and is not a socket"),  # the server would have replaced the file
    ],
)
def test_serve_at_a_socket_path_no_server_can_have(tmp_path, sock, msg):
    (tmp_path / "notes.txt").write_text("a user's file\n")
    sock = str(tmp_path / sock[1:]) if sock.startswith("@") else sock
    refused_in(["serve", "--idle", "5"], tmp_path, 2, msg, REPRO_SERVER=sock)
    assert (tmp_path / "notes.txt").read_text() == "a user's file\n"


@pytest.mark.parametrize(
    "args",
    [
        ("serve", "--idle", "nan"),
        ("serve", "--idle", "inf"),
        ("matrix", "--timeout", "nan"),
        ("matrix", "--dry-run", "--timeout=-inf"),
        ("run", "--backend", "vllm", "--timeout", "inf"),
        ("gate", "--timeout", "nan", "--dry-run"),
        ("gate", "--timeout", "0"),
    ],
    ids=lambda a: " ".join(a),
)
def test_nan_and_inf_are_refused_wherever_seconds_are_read(tmp_path, args):
    refused_in(list(args), tmp_path, 2, "must be a positive, finite number of seconds")


@pytest.mark.parametrize("args", [("matrix", "--window", "-5"), ("run", "--backend", "vllm", "--window", "-2")])
def test_window_below_minus_one_is_refused(tmp_path, args):
    refused_in(list(args), tmp_path, 2, "--window must be -1 (no window) or >= 0")


@pytest.mark.parametrize(
    "overlay, code, msg",
    [
        ("bogus", 2, "is not LABEL=SOURCES@BASE"),
        ("X=/nonexistent@/nonexistent", 2, "/nonexistent holds no vllm/ package of sources"),
        ("X=@sources@/nonexistent", 2, "/nonexistent holds no vllm package to take the compiled parts from"),
        ("X=@sources@@plain", 2, "has no compiled extensions to overlay"),
        ("0.24.0=@sources@@base", 4, "cannot run here: no CUDA GPU visible"),
    ],
)
def test_gate_overlay_is_judged_before_anything_is_made(tmp_path, overlay, code, msg):
    fake_vllm(tmp_path / "sources", compiled=False)
    fake_vllm(tmp_path / "plain", compiled=False)
    fake_vllm(tmp_path / "base", compiled=True)
    overlay = overlay.replace("@sources", str(tmp_path / "sources")).replace("@base", str(tmp_path / "base"))
    overlay = overlay.replace("@plain", str(tmp_path / "plain"))
    refused_in(["gate", "--no-installed", "--overlay", overlay], tmp_path, code, msg)
    if code == 4:  # listing its cases makes nothing either
        before = tree(tmp_path)
        r = main_in(["gate", "--no-installed", "--overlay", overlay, "--dry-run"], tmp_path)
        assert r.returncode == 0 and "stale_metadata-vllm-0.24.0-under-test-audit" in r.stdout, r.stderr
        assert tree(tmp_path) == before


@pytest.mark.parametrize(
    "args",
    [("gate", "--repeat", "100000000", "--dry-run"), ("matrix", "--repeat", "100000000"), ("gate", "--repeat", "0")],
    ids=lambda a: " ".join(a),
)
def test_repeat_is_bounded(tmp_path, args):
    t0 = time.time()
    refused(repro_cmd(*args), tmp_path, 2, "argument --repeat: must be 1 to 1000", timeout=60)
    assert time.time() - t0 < 30


def test_the_largest_repeat_lists_at_once(tmp_path):
    build = fake_vllm(tmp_path / "vllm-0.25.1", compiled=True)
    t0 = time.time()
    args = [
        "gate",
        "--no-installed",
        "--control",
        f"0.25.1={build}",
        "--repeat",
        "1000",
        "--dry-run",
        "--methods",
        "eagle",
    ]
    r = main_in(args, tmp_path)
    assert r.returncode == 0 and len(r.stdout.split()) == 2000 and time.time() - t0 < 60, r.stderr


@pytest.mark.parametrize(
    "args, msg",
    [
        (("--modes", "audit,audit"), "--modes: audit given twice"),
        (("--modes", "memcheck,memcheck:caching"), "--modes: memcheck given twice"),  # one mode, two spellings
        (("--backends", "FLASH_ATTN,FLASH_ATTN"), "--backends: FLASH_ATTN given twice"),
        (("--backends", "flash_attn,FLASH_ATTN"), "--backends: FLASH_ATTN given twice"),
        (("--backends", "BOGUS_BACKEND"), "--backends: 'BOGUS_BACKEND' is neither a backend the auditor has a table"),
    ],
)
def test_gate_refuses_a_value_twice_and_an_unknown_backend(tmp_path, args, msg):
    build = fake_vllm(tmp_path / "vllm-0.25.1", compiled=True)
    refused_in(["gate", "--no-installed", "--control", f"0.25.1={build}", *args, "--dry-run"], tmp_path, 2, msg)


def step(*args: str) -> list[str]:
    return [sys.executable, "-m", "repro.vllm_integration.releases.bisect", "step", *args]


def test_bisect_step_bad_input_stops_git_bisect_in_one_line_as_a_subprocess(tmp_path):
    """The step's bad input is the same at every commit: 128 makes `git bisect run` stop (2 would read as "bad")."""
    refused(step("--repo", "/nonexistent"), tmp_path, 128, "--repo /nonexistent: no such folder")


@pytest.mark.parametrize(
    "cmd, msg",
    [
        (
            ["step", "--repo", ".", "--overlay", "/nonexistent", "--check", "gate", "--", "true"],
            "--overlay /nonexistent",
        ),
        (["step", "--check", "bogus"], "argument --check: invalid choice: 'bogus'"),
        (["bisect", "--vllm", ".", "--overlay", "/nonexistent"], "--overlay /nonexistent: no such folder"),
    ],
    ids=lambda c: " ".join(c) if isinstance(c, list) else c,
)
def test_bisect_step_bad_input_stops_git_bisect_and_bisect_refuses_it_in_one_line(tmp_path, cmd, msg):
    from repro.vllm_integration.releases import bisect  # the step's own entry (python -m ...releases.bisect)

    code = 128 if cmd[0] == "step" else 2  # the step's: git bisect run stops; `repro bisect` refuses before git runs
    refused_in(cmd, tmp_path, code, msg, entry=bisect.main if cmd[0] == "step" else None)


@pytest.mark.parametrize(
    "args, msg",
    [
        (("gate", "--no-installed", "--out", "/proc/x"), "--out /proc/x: cannot create it"),
        (("gate", "--no-installed", "--logs", "/proc/x"), "--logs /proc/x: cannot create it"),
        (("gate", "--no-installed", "--cache-dir", "/proc/x"), "--cache-dir /proc/x: cannot create it"),
        (("gate", "--no-installed", "--compare-paths", "--paths", "bogus"), "--paths bogus: pick each from old,"),
        (("gate", "--no-installed", "--compare-paths", "--paths", "old,old"), "at most once"),
        (("gate", "--no-installed", "--paths", "old"), "--paths old: picks the paths of --compare-paths"),
        (("run", "--backend", "vllm", "--backend-path", "@notes.txt"), "not a shared library"),
        (
            ("run", "--backend", "vllm", "--backend-path", "@lib"),
            "vllm takes vLLM's _vllm_fa3_C*.so file, not a folder",
        ),
        (("run", "--backend", "upstream", "--backend-path", "@lib"), "upstream takes a folder holding flash_attn_3/"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, tuple) else None,
)
def test_bad_values_are_judged_before_builds_or_a_gpu(tmp_path, args, msg):
    (tmp_path / "notes.txt").write_text("not a library\n")
    (tmp_path / "lib").mkdir()
    args = [str(tmp_path / a[1:]) if a.startswith("@") else a for a in args]
    refused_in(args, tmp_path, 2, msg)


def test_vllm_check_of_a_zip_without_vllm_names_the_file(tmp_path):
    whl = tmp_path / "random.whl"
    with zipfile.ZipFile(whl, "w") as z:
        z.writestr("other/__init__.py", "")
    r = refused_in(["vllm-check", str(whl)], tmp_path, 2, f"{whl}: not a vLLM wheel (no vllm/ package inside)")
    assert str(tmp_path / "tmp") not in r.stderr


def test_git_bisect_run_stops_at_a_steps_bad_input_instead_of_naming_a_first_bad_commit(tmp_path):
    """The hand-run flow (docs/vllm-gate.md): `git bisect run python -m repro.vllm_integration.releases.bisect step
    ... --overlay PATH -- CMD` with a mistyped overlay. Its 2 once told git "bad" at every commit, and git named a
    first bad commit although CMD says every commit is good; 128 makes git bisect stop and name none."""
    from tests.fake_vllm import MANAGER_GOOD, write_manager_history

    repo = tmp_path / "vllm"
    write_manager_history(repo, [MANAGER_GOOD + f"\n# change {i}\n" for i in range(3)])
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "bisect", "start", "HEAD", "HEAD~3"], check=True, capture_output=True)
    step = [sys.executable, "-m", "repro.vllm_integration.releases.bisect", "step", "--check", "gate"]
    r = subprocess.run(
        [*git, "bisect", "run", *step, "--overlay", str(tmp_path / "nonexistent"), "--", "true"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert r.returncode != 0 and "is the first bad commit" not in r.stdout, r.stdout[-2000:]
    assert "no such folder" in r.stderr + r.stdout
