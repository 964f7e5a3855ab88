"""One rule for every path a command writes and every path it reads (docs/outputs.md): a report file is a regular file
or a new one, never a device node, a fifo, a folder, a symbolic link or an input, and an existing file is replaced only
when it is a report of the command's own kind; a file read is a regular file of bounded size and JSON of bounded depth,
anything else one line on stderr and exit 2, never a MemoryError or RecursionError traceback. Links are never followed
by `redact` nor packed by `records --add`; a record is never replaced without a word. Each test fails on the code
before this rule (a new user's fifth round)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from repro.errors import ConfigError
from repro.files import write_whole
from tests.commands import ROOT, main_in, refused_in
from tests.records import RESULTS

WRITERS = [  # (a command line whose report file is {out}, its inputs made by _inputs)
    ["agree", "{plain}", "--out", "{out}"],
    ["bench", "--paths", "{plain}", "{plain2}", "--out", "{out}"],
    ["xdist-report", "{junit}", "--out", "{out}"],
    ["matrix", "--model", "--quiet", "--json", "{out}"],
    ["run", "--model", "--json", "{out}"],
    ["vllm-check", "{wheel}", "--json", "{out}"],
    ["plugin-request", "--audit-file", "{out}"],
]
IDS = [w[0] for w in WRITERS]


def _inputs(tmp_path: Path) -> dict[str, str]:
    import zipfile

    plain = tmp_path / "plain.json"
    plain.write_bytes((RESULTS / "h200-default" / "results.json").read_bytes())
    shutil.copy(plain, tmp_path / "plain2.json")
    (tmp_path / "j.xml").write_text('<testsuite name="x"><testcase name="a"/></testsuite>')
    with zipfile.ZipFile(tmp_path / "vllm-0.26.0-py3-none-any.whl", "w") as z:
        z.writestr("vllm/__init__.py", "")
    return {
        "plain": str(plain),
        "plain2": str(tmp_path / "plain2.json"),
        "junit": str(tmp_path / "j.xml"),
        "wheel": str(tmp_path / "vllm-0.26.0-py3-none-any.whl"),
    }


def _args(command: list[str], tmp_path: Path, out: Path) -> list[str]:
    given = _inputs(tmp_path) | {"out": str(out)}
    return [a.format(**given) for a in command]


def _standins(tmp_path: Path) -> dict[str, Path]:
    """What a report file must never replace, each made here: a fifo, a link to a file, a link to nothing, a folder,
    and (as root) a character device as /dev/null is one."""
    made = {}
    os.mkfifo(tmp_path / "fifo")
    made["fifo"] = tmp_path / "fifo"
    (tmp_path / "target.md").write_text("# CPU model against the H200\n")
    (tmp_path / "link").symlink_to(tmp_path / "target.md")
    made["link"] = tmp_path / "link"
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    made["dangling link"] = tmp_path / "dangling"
    (tmp_path / "folder").mkdir()
    made["folder"] = tmp_path / "folder"
    if os.geteuid() == 0:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))  # /dev/null's numbers
        made["char device"] = tmp_path / "null"
    return made


def _kind(p: Path) -> tuple[int, int]:
    st = os.lstat(p)
    return stat.S_IFMT(st.st_mode), st.st_ino


@pytest.mark.parametrize("command", WRITERS, ids=IDS)
def test_a_report_file_is_never_a_device_a_fifo_a_link_or_a_folder_and_each_is_kept(tmp_path, command):
    for what, standin in _standins(tmp_path).items():
        before = _kind(standin)
        r = main_in(_args(command, tmp_path, standin), tmp_path)
        assert r.returncode == 2, (command[0], what, r.returncode, r.stderr[-800:])
        assert len(r.stderr.strip().splitlines()) == 1, (what, r.stderr)
        assert _kind(standin) == before, f"{command[0]} replaced the {what}"
    assert (tmp_path / "target.md").read_text() == "# CPU model against the H200\n"


@pytest.mark.skipif(os.geteuid() != 0, reason="making a character device needs root (mknod): the fifo stands in")
def test_as_root_a_char_device_such_as_dev_null_is_never_replaced(tmp_path):
    os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    with pytest.raises(ConfigError, match="a device"):
        write_whole(tmp_path / "null", "x")
    assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)


def test_the_one_writer_refuses_a_path_that_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere.txt")
    for p in (tmp_path / "fifo", tmp_path / "link"):
        with pytest.raises(ConfigError, match="not a regular file"):
            write_whole(p, "x")
    assert not (tmp_path / "elsewhere.txt").exists() and stat.S_ISFIFO(os.lstat(tmp_path / "fifo").st_mode)
    write_whole(tmp_path / "new.txt", "x")  # a new file, and a regular one, are written
    write_whole(tmp_path / "new.txt", "y")
    assert (tmp_path / "new.txt").read_text() == "y"


@pytest.mark.parametrize(
    "command",
    [WRITERS[0], WRITERS[1], WRITERS[2]],
    ids=["agree", "bench", "xdist-report"],
)
def test_a_markdown_report_never_replaces_a_text_file_that_is_not_its_own_report(tmp_path, command):
    for name, text in (
        ("victim.py", (ROOT / "conftest.py").read_text()),
        ("README.md", "# A project\n\nwords\n"),
        ("verdicts.md", "# Verdicts\n"),
        ("notreport.json", '{"a": 1}\n'),
    ):
        (tmp_path / name).write_text(text)
        r = main_in(_args(command, tmp_path, tmp_path / name), tmp_path)
        assert r.returncode == 2 and "not a report this command writes" in r.stderr, (name, r.stderr[-500:])
        assert (tmp_path / name).read_text() == text


def test_a_markdown_report_replaces_its_own_earlier_report(tmp_path):
    args = _args(WRITERS[1], tmp_path, tmp_path / "x.md")
    first = main_in(args, tmp_path)
    assert (tmp_path / "x.md").read_text().startswith("## Case execution paths"), first.stderr[-500:]
    again = main_in(args, tmp_path)
    assert first.returncode == again.returncode and "not a report" not in again.stderr


def test_matrix_json_never_replaces_a_gpu_record_with_cpu_predictions(tmp_path):
    gpu = tmp_path / "results.json"
    gpu.write_bytes((RESULTS / "h200-default" / "results.json").read_bytes())
    before = gpu.read_bytes()
    r = main_in(["matrix", "--model", "--quiet", "--json", str(gpu)], tmp_path)
    assert r.returncode == 2 and gpu.read_bytes() == before, r.stderr[-500:]
    predicted = tmp_path / "predicted.json"
    assert main_in(["matrix", "--model", "--quiet", "--json", str(predicted)], tmp_path).returncode in (0, 1)
    assert main_in(["matrix", "--model", "--quiet", "--json", str(predicted)], tmp_path).returncode in (0, 1)


READERS = [  # a command reading {bad} as an input ({good}: a recorded results.json beside it)
    ["agree", "{bad}"],
    ["bench", "{bad}", "{good}"],
    ["bench", "--paths", "{good}", "{bad}"],
    ["xdist-report", "{bad}"],
]


@pytest.mark.parametrize("command", READERS, ids=["agree", "bench", "bench-paths", "xdist-report"])
def test_an_input_that_is_a_device_a_fifo_deep_or_huge_is_one_line_and_exit_2(tmp_path, command, monkeypatch):
    import repro.files

    monkeypatch.setattr(repro.files, "READ_LIMIT", 1 << 20)  # a huge file, at a small bound
    good = _inputs(tmp_path)["plain"]
    (tmp_path / "deep.json").write_text("[" * 100000 + "]" * 100000)  # past the interpreter's recursion limit
    (tmp_path / "deep2.json").write_text('{"cases": ' + "[" * 100 + "]" * 100 + "}")  # under it, over the bound
    (tmp_path / "huge.json").write_bytes(b" " * ((1 << 20) + 10))
    os.mkfifo(tmp_path / "fifo")
    for bad in (
        "/dev/zero",
        "/dev/full",
        *(str(tmp_path / n) for n in ("fifo", "deep.json", "deep2.json", "huge.json")),
    ):
        r = main_in([a.format(bad=bad, good=good) for a in command], tmp_path)
        assert r.returncode == 2, (command, bad, r.returncode, r.stderr[-500:])
        assert len(r.stderr.strip().splitlines()) == 1, (command, bad, r.stderr[-500:])


def test_bench_refuses_seconds_that_are_not_numbers_in_one_line(tmp_path):
    doc = json.loads((RESULTS / "h200-default" / "results.json").read_text())
    doc["wall_s"] = "fast"
    for name in ("a.json", "b.json"):
        (tmp_path / name).write_text(json.dumps(doc))
    r = main_in(["bench", "--paths", str(tmp_path / "a.json"), str(tmp_path / "b.json")], tmp_path)
    assert r.returncode == 2 and "'wall_s' is str" in r.stderr, r.stderr[-500:]


def test_redact_never_follows_a_link_it_is_given(tmp_path):
    outside = tmp_path / "outside.txt"
    outside.write_text("/home/someone/work/file.txt\n")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "link.txt").symlink_to(outside)
    r = main_in(["redact", str(tmp_path / "d" / "link.txt")], tmp_path)
    assert r.returncode == 2 and "symbolic link" in r.stderr, r.stderr
    assert outside.read_text() == "/home/someone/work/file.txt\n"


def _records_repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    (root / "results" / "rec").mkdir(parents=True)
    (root / "results" / "rec" / "results.json").write_text(json.dumps({"kind": "x", "cases": []}))
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_records_add_never_packs_what_a_link_in_a_record_points_to(tmp_path):
    root = _records_repo(tmp_path)
    (root / "results" / "rec" / "passwd").symlink_to("/etc/passwd")
    r = main_in(["records", "--add", "rec", "--root", str(root)], tmp_path)
    assert r.returncode == 2 and "symbolic link" in r.stderr, r.stderr[-500:]
    assert not (root / "results" / "rec.tar.xz").exists() and (root / "results" / "rec").is_dir()


def test_records_add_never_replaces_a_packed_record_without_a_word(tmp_path):
    from repro.report import records

    root = _records_repo(tmp_path)
    (root / "results" / "rec.tar.xz").write_bytes(records.packed(root / "results" / "rec"))
    before = (root / "results" / "rec.tar.xz").read_bytes()
    (root / "results" / "rec" / "more.json").write_text("{}")
    r = main_in(["records", "--add", "rec", "--root", str(root)], tmp_path)
    assert r.returncode == 2 and "both exist" in r.stderr, r.stderr[-500:]
    assert (root / "results" / "rec.tar.xz").read_bytes() == before


def test_records_unpack_of_an_empty_name_is_bad_input_and_writes_nothing(tmp_path):
    root = _records_repo(tmp_path)
    refused_in(["records", "--unpack", "", "--root", str(root)], tmp_path, 2, "--unpack ''")


def test_a_truncated_wheel_is_untestable(tmp_path):
    wheel = Path(_inputs(tmp_path)["wheel"])
    import zipfile

    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/__init__.py", "x = 1\n" * 2000)
    data = wheel.read_bytes()
    wheel.write_bytes(data[: len(data) // 2])
    r = main_in(["vllm-check", str(wheel)], tmp_path)
    assert r.returncode == 125, (r.returncode, r.stderr[-500:], r.stdout[-500:])


@pytest.mark.parametrize(
    "var, value",
    [
        ("REPRO_GATE_METHODS", "nonsense"),
        ("REPRO_GATE_MODES", "nonsense"),
        ("REPRO_GATE_TIMEOUT", "soon"),
        ("REPRO_SELF_CONTROL", "nonsense"),
    ],  # fmt: skip
)
def test_pytest_gate_names_a_variable_it_cannot_read_as_bad_input(tmp_path, var, value):
    env = {**os.environ, var: value, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:xdist", "-q", "--gate", "-k", "stale_metadata", "-p", "no:cacheprovider",
         "cases/test_vllm_gate.py"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert r.returncode == 2, (r.returncode, r.stdout[-800:], r.stderr[-800:])
    assert var in r.stderr and "no GPU" not in r.stdout + r.stderr, r.stderr[-800:]


def test_ctrl_c_of_pytest_gate_is_130_not_bad_input():
    from repro.exit_codes import Exit, pytest_session

    assert pytest_session(2, gate_passed=False) == Exit.INTERRUPTED == 130
    assert pytest_session(0, gate_passed=True) == 0 and pytest_session(0, gate_passed=False) == 1


def test_redact_refuses_a_device_a_fifo_and_an_empty_name_in_one_line(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    for given, said in (("/dev/zero", "neither a file nor a folder"), (str(tmp_path / "fifo"), "neither"), ("", "''")):
        r = main_in(["redact", given], tmp_path)
        assert r.returncode == 2 and said in r.stderr and len(r.stderr.strip().splitlines()) == 1, (given, r.stderr)


def test_a_record_and_its_hard_link_are_one_record_and_a_folder_is_no_input(tmp_path):
    plain = Path(_inputs(tmp_path)["plain"])
    os.link(plain, tmp_path / "hard.json")
    r = main_in(["agree", str(plain), str(tmp_path / "hard.json")], tmp_path)
    assert r.returncode == 2 and "are one record" in r.stderr, r.stderr[-500:]
    (tmp_path / "folder").mkdir()
    r = main_in(["agree", str(tmp_path / "folder")], tmp_path)
    assert r.returncode == 2 and "a folder" in r.stderr, r.stderr[-500:]
