"""What a new user runs into, each guarantee a test: no command destroys or leaves behind what the user did
not ask for (docs/outputs.md, repro/cli/outputs.py), every exit code means what docs/exit-codes.md says, values that
make no sense are refused, messages name the right thing, README and `vllm-check` say what was measured and what was
predicted, help texts agree with the docs, long work says what it does. Where a real process is not needed the
command runs in this process through repro.cli.main."""

from __future__ import annotations

import base64
import fcntl
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from repro.cli import main, outputs
from repro.exit_codes import EXIT_CODES
from repro.vllm_integration.releases import versions
from tests.commands import (
    ROOT,
    fake_vllm,
    isolated_env,
    main_in,
    refused_in,
    repro_cmd,
    run_repro,
    tree,
)
from tests.processes import at_a_terminal
from tests.records import RESULTS


def _main(*args: str) -> int:
    """repro.cli.main in this process; an argparse refusal's SystemExit as its code."""
    try:
        return int(main(list(args)))
    except SystemExit as e:
        return int(e.code)


def _wheel(path: Path, files: dict[str, str], stored: bool = False) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=a", *args],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def _repo(path: Path, commits: int = 5) -> Path:
    """A git checkout holding vllm/, `commits` commits 'change 1'..., on branch work."""
    (path / "vllm").mkdir(parents=True)
    _git(path, "init", "-q")
    for i in range(1, commits + 1):
        (path / "vllm" / "__init__.py").write_text(f"x = {i}\n")
        _git(path, "add", "-A")
        _git(path, "commit", "-qm", f"change {i}")
    _git(path, "checkout", "-q", "-b", "work")
    return path


# 1. An output file is never one of the inputs, and an existing file of another kind is kept.


def test_vllm_check_never_overwrites_the_wheel_it_reads_directly_or_through_a_link(tmp_path, capsys):
    wheel = _wheel(tmp_path / "vllm-0.30.0-py3-none-any.whl", {"vllm/__init__.py": "", "vllm/x.py": "y = 1\n"})
    before = wheel.read_bytes()
    (tmp_path / "link.json").symlink_to(wheel)
    (tmp_path / "notes.txt").write_text("my notes\n")
    for target in (wheel, tmp_path / "link.json", tmp_path / "notes.txt"):
        assert _main("vllm-check", str(wheel), "--json", str(target)) == 2, target
    err = capsys.readouterr().err
    assert err.count("one of this command's inputs") == 1 and "is not a report this command writes" in err
    assert "link.json: is a symbolic link" in err  # a link is never a report file, whatever it leads to
    assert wheel.read_bytes() == before and (tmp_path / "notes.txt").read_text() == "my notes\n"
    assert _main("vllm-check", str(wheel), "--json", str(tmp_path / "v.json")) in (0, 1, 125)
    assert _main("vllm-check", str(wheel), "--json", str(tmp_path / "v.json")) in (0, 1, 125)  # its own: replaced


def test_report_files_of_agree_bench_and_xdist_report_are_never_their_inputs(tmp_path, capsys):
    record = tmp_path / "results.json"
    record.write_bytes((RESULTS / "h200-default" / "results.json").read_bytes())
    before = record.read_bytes()
    assert _main("bench", "--paths", str(record), str(record), "--out", str(record)) == 2
    (tmp_path / "j.xml").write_text('<testsuite name="x"></testsuite>')
    assert _main("xdist-report", str(tmp_path / "j.xml"), "--out", str(tmp_path / "j.xml")) == 2
    assert record.read_bytes() == before and "one of this command's inputs" in capsys.readouterr().err


# 2. bisect gives the checkout back, refuses a bisect in progress, one run per checkout.


def test_bisect_refuses_a_bisect_the_user_has_in_progress_and_leaves_it_as_it_was(tmp_path):
    repo = _repo(tmp_path / "src")
    _git(repo, "bisect", "start", "HEAD", "HEAD~3")
    head = _git(repo, "rev-parse", "HEAD")
    r = main_in(["bisect", "--vllm", str(repo), "--good", "HEAD~1", "--bad", "HEAD"], tmp_path)
    assert r.returncode == 2 and "a git bisect is in progress" in r.stderr
    assert (repo / ".git" / "BISECT_LOG").exists() and _git(repo, "rev-parse", "HEAD") == head


def test_bisect_gives_the_checkout_back_after_ctrl_c_and_allows_one_run_per_checkout(tmp_path):
    repo = _repo(tmp_path / "src")
    head = _git(repo, "rev-parse", "HEAD")
    slow = [sys.executable, "-c", "import time; time.sleep(60)"]
    cmd = repro_cmd("bisect", "--vllm", str(repo), "--good", "HEAD~4", "--bad", "HEAD", "--check", "gate", "--", *slow)
    env = isolated_env(tmp_path)
    first = subprocess.Popen(
        cmd, cwd=tmp_path, env=env, start_new_session=True, stdout=subprocess.PIPE, text=True, preexec_fn=at_a_terminal
    )
    try:
        for _ in range(300):  # until git bisect has moved the checkout
            if (repo / ".git" / "BISECT_LOG").exists() and _git(repo, "rev-parse", "HEAD") != head:
                break
            time.sleep(0.1)
        second = main_in(["bisect", "--vllm", str(repo), "--good", "HEAD~4", "--bad", "HEAD"], tmp_path)
        assert second.returncode == 2 and "another `repro bisect` runs on this checkout" in second.stderr
        os.killpg(first.pid, signal.SIGINT)  # Ctrl-C at a terminal: the whole foreground group
        assert first.wait(timeout=60) == 130
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    assert not (repo / ".git" / "BISECT_LOG").exists() and not (repo / ".git" / "BISECT_START").exists()
    assert _git(repo, "symbolic-ref", "--short", "HEAD") == "work" and _git(repo, "rev-parse", "HEAD") == head
    assert _git(repo, "status", "--porcelain") == ""


def test_bisect_names_the_first_bad_commit_with_its_subject_and_shows_no_diffstat(tmp_path):
    from tests.fake_vllm import MANAGER_BAD, MANAGER_GOOD, write_manager_history

    repo = tmp_path / "vllm-repo"
    write_manager_history(repo, [MANAGER_GOOD + "\n# 0\n", MANAGER_BAD, MANAGER_BAD + "\n# later\n"])
    r = run_repro("bisect", "--vllm", str(repo), "--good", "HEAD~3", "--bad", "HEAD")
    assert r.returncode == 0, r.stderr
    bad = _git(repo, "rev-parse", "HEAD~1")
    assert f"first bad commit: {bad} change 1" in r.stdout
    assert "insertion" not in r.stdout and "file changed" not in r.stdout  # git's diffstat stays out


# 3. redact never leaves the folder it was given through a link.


def test_redact_never_rewrites_a_file_outside_its_folder_through_a_link(tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.json").write_text('{"p": "/home/someone/work/file.txt"}\n')
    inside = tmp_path / "records"
    inside.mkdir()
    (inside / "link.json").symlink_to(outside / "secret.json")
    (inside / "folder").symlink_to(outside)
    (inside / "mine.json").write_text('{"p": "/home/someone/work/file.txt"}\n')
    assert _main("redact", str(inside)) == 0
    assert "/home/someone" in (outside / "secret.json").read_text()
    assert "/home/someone" not in (inside / "mine.json").read_text()


def test_redact_refuses_a_file_it_cannot_write_in_one_line_before_rewriting_any(tmp_path, capsys, monkeypatch):
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text('{"p": "/home/someone/work/file.txt"}\n')
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: real(p, mode) and Path(p).name != "b.json")  # root writes all
    assert _main("redact", str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "b.json: cannot write it" in err and len(err.strip().splitlines()) == 1
    assert "/home/someone" in (tmp_path / "a.json").read_text()  # nothing rewritten


# 4. serve: no folder above the socket; Ctrl-C while it starts leaves no server.


def test_serve_makes_no_folder_for_the_socket_it_is_given(tmp_path):
    sock = tmp_path / "nonexistent" / "dir" / "s.sock"
    refused_in(["serve"], tmp_path, 2, "does not exist", REPRO_SERVER=str(sock))
    assert not (tmp_path / "nonexistent").exists()


def test_serve_interrupted_while_it_starts_stops_the_server_it_started(tmp_path):
    sock = tmp_path / "s.sock"
    env = isolated_env(tmp_path, REPRO_SERVER=str(sock))
    cmd = repro_cmd("serve", "--idle", "600")
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True, preexec_fn=at_a_terminal)
    for _ in range(200):  # the server's log appears when it is started, its socket once it imported
        if sock.with_suffix(".log").exists():
            break
        time.sleep(0.05)
    time.sleep(0.3)  # the server is starting: its imports take seconds
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=60) == 130
    time.sleep(0.5)
    left = [c for c in Path("/proc").glob("[0-9]*/cmdline") if _cmdline_has(c, str(sock))]
    assert not left and not sock.exists()


def _cmdline_has(path: Path, text: str) -> bool:
    try:
        return text in path.read_bytes().decode(errors="replace")
    except OSError:
        return False


# 5. Report folders: one rule (new or empty, --overwrite, a lock), nothing half-done left unmarked.


def test_a_report_folder_holding_a_report_is_refused_unless_overwrite(tmp_path, capsys):
    out = tmp_path / "o"
    assert _main("matrix", "--out", str(out), "--quiet") == 0
    first = (out / "verdicts.md").stat().st_mtime_ns
    assert _main("matrix", "--out", str(out), "--quiet") == 2
    assert "holds a report of an earlier run" in capsys.readouterr().err
    assert (out / "verdicts.md").stat().st_mtime_ns == first
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "thesis.tex").write_text("x")
    assert _main("matrix", "--out", str(tmp_path / "mine"), "--overwrite", "--quiet") == 2  # not a report folder
    assert (tmp_path / "mine" / "thesis.tex").exists()
    assert _main("matrix", "--out", str(out), "--overwrite", "--quiet") == 0
    assert json.loads((out / outputs.MARKER).read_text())["state"] == "complete"


def test_two_commands_never_write_one_report_folder_at_once(tmp_path, capsys):
    out = tmp_path / "o"
    out.mkdir()
    marker = out / outputs.MARKER
    marker.write_text(json.dumps({"command": "gate", "pid": 1, "state": "running"}))
    fd = os.open(marker, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert _main("matrix", "--out", str(out), "--overwrite", "--quiet") == 2
    finally:
        os.close(fd)
    assert "`gate` (pid 1) is writing into it now" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [outputs.MARKER]


def test_an_early_stop_removes_an_empty_report_folder_and_marks_a_partial_one(tmp_path):
    empty = outputs.open_folder(str(tmp_path / "made" / "for" / "it"), "gate")
    partial = outputs.open_folder(str(tmp_path / "partial"), "gate")
    (partial / "logs").mkdir()
    (partial / "logs" / "case.log").write_text("half")
    assert empty.exists()
    outputs.abandon("interrupted with Ctrl-C")
    assert not (tmp_path / "made").exists()  # with the parents made for it
    assert "interrupted with Ctrl-C" in (partial / outputs.INTERRUPTED).read_text()
    assert json.loads((partial / outputs.MARKER).read_text())["state"] == "interrupted"


def test_ctrl_c_during_matrix_leaves_no_unmarked_report_folder_and_stops_at_once(tmp_path):
    out = tmp_path / "o"
    p = subprocess.Popen(
        repro_cmd("matrix", "--out", str(out)), cwd=tmp_path, env=isolated_env(tmp_path), start_new_session=True,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=at_a_terminal,
    )  # fmt: skip
    assert p.stderr.readline().startswith("[matrix] ")  # past its imports and checks: a command at work
    time.sleep(0.5)
    os.killpg(p.pid, signal.SIGINT)
    t0 = time.time()
    code = p.wait(timeout=60)
    # it waited for its environment probe before: 10 s; a loaded 2-core CI machine took 7.2 s to exit after the stop
    assert time.time() - t0 < 9
    if code == 130:
        assert not out.exists() or (out / outputs.INTERRUPTED).exists(), sorted(map(str, tree(out)))
    else:  # it finished first: a complete report
        assert code == 0 and (out / "verdicts.md").exists()


# 6. gate: a refused value writes nothing, a gate that cannot run here writes nothing (no cache either).


def test_gate_with_a_bad_devices_writes_nothing(tmp_path):
    fake_vllm(tmp_path / "standin", compiled=False)
    for devices in ("0,0", ","):
        refused_in(
            ["gate", "--no-installed", "--vllm", f"x={tmp_path / 'standin'}", "--devices", devices, "--out",
             str(tmp_path / "o")],
            tmp_path, 2, "--devices", HOME=str(tmp_path),
        )  # fmt: skip


def test_a_gate_that_cannot_run_here_writes_nothing_not_even_its_cache(tmp_path):
    src = fake_vllm(tmp_path / "checkout", compiled=False)
    (src / "vllm" / "entrypoints").mkdir()  # a real vLLM's sources, without their compiled parts
    r = refused_in(
        ["gate", "--no-installed", "--vllm", f"x={src}", "--out", str(tmp_path / "o")],
        tmp_path, 4, "cannot run here", HOME=str(tmp_path),
    )  # fmt: skip
    assert "HARNESS BLIND" not in r.stdout + r.stderr


# 7. Exit codes: a damaged wheel is untestable, not "affected".


def test_a_damaged_wheel_is_untestable_not_affected(tmp_path):
    wheel = _wheel(tmp_path / "vllm-0.25.1-py3-none-any.whl", {"vllm/__init__.py": "", "vllm/a.py": "A" * 64}, True)
    data = wheel.read_bytes()
    wheel.write_bytes(data.replace(b"A" * 64, b"B" * 64))  # the member's bytes no longer match its CRC
    r = main_in(["vllm-check", str(wheel)], tmp_path)
    assert r.returncode == 125 and "cannot read the wheel" in r.stdout


# 8. One outcome, one headline.


def test_harness_blind_is_never_printed_under_a_cannot_vouch_outcome(monkeypatch, tmp_path):
    from repro.vllm_integration.gate import report
    from tests.recorded_gate import replay

    _, _, run, _ = replay(monkeypatch, tmp_path, RESULTS / "h200-hidden-sweep-full")  # MPS 24/40 broken
    assert str(run.outcome()) == "CANNOT VOUCH" and run.blind()
    md = report.markdown(run)
    assert "HARNESS BLIND" not in md.split("| case |")[0] and "under this CANNOT VOUCH outcome" in md


# 9. "Not a vLLM source" is one code everywhere; other codes as the table says.


def test_not_a_vllm_source_is_bad_input_in_every_command(tmp_path):
    (tmp_path / "empty").mkdir()
    _wheel(tmp_path / "other.whl", {"pkg/__init__.py": ""})
    repo = tmp_path / "repo"
    (repo / "src").mkdir(parents=True)
    (repo / "src" / "x.py").write_text("")
    _git(repo, "init", "-q")
    _git(repo, "add", "-A")
    _git(repo, "commit", "-qm", "x")
    codes = {
        "vllm-check DIR": _main("vllm-check", str(tmp_path / "empty")),
        "vllm-check WHEEL": _main("vllm-check", str(tmp_path / "other.whl")),
        "bisect": _main("bisect", "--vllm", str(repo), "--good", "HEAD", "--bad", "HEAD"),
        "bisect --status": _main("bisect", "--vllm", str(repo), "--status"),
    }
    assert set(codes.values()) == {2}, codes


def test_xml_that_is_not_junit_is_bad_input_for_xdist_report(tmp_path, capsys):
    (tmp_path / "x.xml").write_text('<?xml version="1.0"?><config/>')
    assert _main("xdist-report", str(tmp_path / "x.xml")) == 2
    assert "not a JUnit XML" in capsys.readouterr().err


def test_no_gpu_behind_devices_all_is_could_not_run_here(tmp_path):
    fake_vllm(tmp_path / "standin", compiled=False)
    refused_in(
        ["gate", "--no-installed", "--vllm", f"x={tmp_path / 'standin'}", "--devices", "all"],
        tmp_path, 4, "cannot run here", HOME=str(tmp_path),
    )  # fmt: skip


def test_pytest_usage_errors_keep_pytests_code_and_the_table_says_so(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--gate=yes", "--co", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, cwd=tmp_path, env=isolated_env(tmp_path), timeout=120,
    )  # fmt: skip
    assert r.returncode == pytest.ExitCode.USAGE_ERROR == 4
    assert (
        "usage error" in EXIT_CODES["pytest --gate"][4] and "not 'could not run here'" in EXIT_CODES["pytest --gate"][4]
    )
    assert "pytest's USAGE_ERROR" in (ROOT / "docs" / "exit-codes.md").read_text()


# 10. Values that make no sense are refused before anything runs.


def _standin(tmp_path: Path, name: str = "standin") -> str:
    return str(fake_vllm(tmp_path / name, compiled=False))


@pytest.mark.parametrize(
    "args",
    [
        ("gate", "--dry-run", "--cache-max-age-days", "nan"),
        ("gate", "--dry-run", "--cache-max-age-days", "inf"),
        ("matrix", "--dry-run", "--splits", "1000000000000"),
        ("run", "--backend", "vllm", "--sm", "full:12"),
        ("run", "--backend", "vllm", "--capture-sizes", "1000", "--max-num-seqs", "4"),
        ("gate", "--dry-run", "--no-installed", "--vllm", "x=@A", "--devices", "0,0"),
        ("gate", "--dry-run", "--no-installed", "--vllm", "x=@A", "--modes", "mps:100000"),
        ("gate", "--dry-run", "--no-installed", "--vllm", "x=@A", "--vllm", "x=@B"),
        ("gate", "--dry-run", "--no-installed", "--vllm", "x=@A", "--control", "x=@B"),
    ],
    ids=lambda a: " ".join(a),
)
def test_values_that_make_no_sense_are_refused(tmp_path, capsys, args):
    a, b = _standin(tmp_path, "a"), _standin(tmp_path, "b")
    given = [x.replace("@A", a).replace("@B", b) for x in args]
    assert _main(*given) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


# 11. Messages name the right thing.


def test_messages_name_what_was_wrong(tmp_path, capsys):
    assert _main("--nope") == 2
    assert "--nope" in capsys.readouterr().err
    assert _main("matrix", "--dry-run", "--model-sms", "16,16") == 2
    assert "--model-sms: 16 given twice" in capsys.readouterr().err
    record = json.loads((RESULTS / "h200-default" / "results.json").read_text())
    del record["cases"][0]["result"]["spec"]["cfg"]
    (tmp_path / "r.json").write_text(json.dumps(record))
    assert _main("bench", "--paths", str(tmp_path / "r.json"), str(tmp_path / "r.json")) == 2
    assert "has no 'cfg' field" in capsys.readouterr().err


def test_a_build_folder_with_a_comma_in_its_name_can_be_named(tmp_path, capsys):
    build = _standin(tmp_path, "vllm,0.25.1")
    assert _main("gate", "--dry-run", "--no-installed", "--vllm", f"x={build}") == 0
    assert "vllm-x-" in capsys.readouterr().out


# 12. Measured where a GPU record exists, predicted elsewhere: README, docs/versions.md, vllm-check.


def test_measured_only_where_a_gpu_record_exists_predicted_elsewhere(tmp_path, capsys):
    records = versions.gpu_records()
    table = {r["version"] for r in versions.load()}
    readme = (ROOT / "README.md").read_text()
    said = re.search(
        r"Measured on the H200: (.*?); predicted from\s+their sources, never run: (.*?) good", readme, re.S
    )
    for v in re.findall(r"\d+\.\d+\.\d+", said.group(1)):
        assert records.get(v), f"README says {v} was measured; no GPU record holds it"
    low, high = re.findall(r"\d+\.\d+\.\d+", said.group(2))
    predicted = {v for v in table if versions.version_key(low) <= versions.version_key(v) <= versions.version_key(high)}
    assert predicted and not any(records.get(v) for v in predicted)
    assert all(v in records or v in predicted for v in table)  # every release recorded is one or the other
    page = (ROOT / "docs" / "versions.md").read_text()
    for v in table:
        row = next(ln for ln in page.splitlines() if ln.startswith(f"| {v} |"))
        assert ("measured" in row) == bool(records.get(v)) and ("predicted" in row) != bool(records.get(v)), row
    empty = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(b"").digest()).rstrip(b"=").decode()
    # vllm-check: these files are never "measured" (they were not compared with the published release's); the GPU
    # record of the release their own RECORD names is shown beside them as the release's
    for n, (v, words, files) in enumerate(
        (
            ("0.30.0", ["these files: predicted", "GPU record of the release: none"], {"vllm/__init__.py": ""}),
            (
                "0.25.1",
                ["these files: predicted", "GPU record of the release: found affected on a GPU (results/"],
                {"vllm/__init__.py": "", "vllm-0.25.1.dist-info/RECORD": f"vllm/__init__.py,{empty},0\n"},
            ),
            ("0.25.1", ["these files: predicted", "GPU record of the release: none"], {"vllm/__init__.py": ""}),
        )
    ):
        (tmp_path / str(n) / v).mkdir(parents=True, exist_ok=True)
        wheel = _wheel(tmp_path / str(n) / v / f"vllm-{v}-py3-none-any.whl", files)
        _main("vllm-check", str(wheel))
        out = capsys.readouterr().out
        assert all(w in out for w in words) and "measured" not in out, (v, files, out)


# 13. The first screen: a GPU user never copies a line that replaces their CUDA torch.


def test_the_first_screen_keeps_the_cpu_torch_line_behind_a_cpu_only_condition():
    lines = (ROOT / "README.md").read_text().splitlines()
    first = "\n".join(lines[:40])
    for i, line in enumerate(lines[:40]):
        if "whl/cpu" in line:
            assert "CPU-only machine ONLY" in line and "Only on a CPU-only machine" in "\n".join(lines[i - 8 : i])
    install = next(ln for ln in lines[:40] if ln.startswith("pip install -e"))
    assert "[test,gpu]" in install and "torch" not in install
    assert "--keep-forkserver" not in first and "--keep-forkserver" in (ROOT / "docs" / "vllm-gate.md").read_text()
    assert "minutes" in next(ln for ln in lines if ln.startswith("python -m pytest -n 2"))


# 14. Help texts agree with the docs.


def test_help_texts_agree_with_the_docs(capsys):
    for cmd in ("gate", "matrix"):
        with pytest.raises(SystemExit):
            main([cmd, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "recorded for 0.23.0 to 0.26.0 only" in text
    assert "recorded for 0.23.0 to 0.26.0 only" in " ".join((ROOT / "docs" / "vllm-gate.md").read_text().split())
    assert "the CPU model's predictions: none" in text


# 15. Long work says what it does.


def test_long_work_says_what_it_does_as_it_goes(tmp_path, capsys, monkeypatch):
    from repro.cli import doctor

    said = []

    def probe(name):  # the slow part: by then the lines before it are out
        assert said, "doctor printed nothing before probing the FA3 builds"
        return "missing (stand-in)"

    monkeypatch.setattr(doctor, "_probe_backend", probe)
    doctor.doctor(say=said.append)
    assert len(said) > 3
    record = str(RESULTS / "h200-default" / "results.json")
    gate_record = str(RESULTS / "h200-compile-none" / "results.json")
    assert _main("agree", record, gate_record, gate_record) in (0, 1)
    err = capsys.readouterr().err
    assert "[agree] 1/1" in err and err.count("note:") == 1
    assert _main("matrix", "--model", "--modes", "eager") == 0  # after every value was judged: a refusal stays one line
    assert "[matrix] predicting 40 case(s) with the CPU model" in capsys.readouterr().err
