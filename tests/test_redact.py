"""Machine paths never reach recorded results."""

import subprocess
from pathlib import Path

from repro.report.redact import redact, redact_tree
from tests.commands import no_traceback, repro_cmd, run_in

ROOT = Path(__file__).parent.parent


def test_paths_become_placeholders():
    assert (
        redact('File "/a/b/main/repro/attention/worker.py", line 3')
        == 'File "<repo>/repro/attention/worker.py", line 3'
    )
    assert redact("--out /x/out/plain --jobs 8") == "--out <path>/plain --jobs 8"
    assert redact("/x/.venv/lib/python3.12/site-packages/torch/a.py:1") == "<site-packages>/torch/a.py:1"
    assert redact('<skipped message="m">/a/main/cases/t.py:44') == '<skipped message="m"><repo>/cases/t.py:44'


def test_text_that_is_not_a_path_is_kept():
    for t in ("16/16 stale/fresh", "see https://docs.nvidia.com/cuda/x.html", "t32r8", "a 1/2 b", "0x7f/0x10"):
        assert redact(t) == t


def test_redact_tree_rewrites_only_records(tmp_path):
    (tmp_path / "r.json").write_text('{"cmd": "python -m repro --out /m/out/x"}')
    (tmp_path / "keep.bin").write_text("/m/out/x")
    assert redact_tree([tmp_path]) == [tmp_path / "r.json"]
    assert "<path>/x" in (tmp_path / "r.json").read_text() and (tmp_path / "keep.bin").read_text() == "/m/out/x"


def test_committed_records_hold_no_machine_paths():
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "results", "tests/fixtures"], capture_output=True, text=True
    ).stdout.split()
    assert files, "no committed records found"
    for f, data in _committed(files):
        if Path(f).suffix in (".json", ".md", ".xml", ".txt", ".log"):
            text = data.decode(errors="replace")
            assert redact(text) == text, f"{f} holds a machine path"


def test_committed_records_hold_no_binary():
    """A record is text (and xz-compressed text); a compiled library or executable a run built (memcheck:own's
    allocator did, into its logs, until it moved to a build folder of its own) is never committed."""
    files = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "results"], capture_output=True, text=True
    ).stdout.split()
    binaries = [f for f, data in _committed(files) if data[:4] == b"\x7fELF"]
    assert binaries == []


def _committed(files: list[str]):
    """(path, bytes) of every committed file, and of every file inside a packed record (results/NAME.tar.xz)."""
    from repro.report.records import PACKED, members

    for f in files:
        p = ROOT / f
        if f.endswith(PACKED):
            yield from ((f"{f}:{rel}", data) for rel, data in members(p, lambda rel: True).items())
        elif p.is_file():
            yield f, p.read_bytes()


def test_redaction_is_idempotent():
    once = redact('File "/a/main/repro/x.py" and /o/out/plain and /v/site-packages/t/a.py')
    assert redact(once) == once


def test_an_overlay_option_keeps_both_of_its_paths_apart():
    """--overlay LABEL=SOURCES@BASE: two paths joined by @, each redacted on its own."""
    assert redact("--overlay 0.33.0-mutant=/tmp/mutsrc@/tmp/v0330 --x") == (
        "--overlay 0.33.0-mutant=<path>/mutsrc@<path>/v0330 --x"
    )


def test_redact_keeps_every_byte_but_the_paths(tmp_path):
    odd = tmp_path / "odd.log"  # not UTF-8, CRLF line endings
    odd.write_bytes(b"\x89 start\r\nlog at /home/u/scratch/x.log\r\n\xff\xfe \xc3 end\r\n")
    png = tmp_path / "heatmap.png"  # binary: NUL bytes, and a path-like run inside
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00 /home/u/scratch/x.log \x00\xff")
    before = png.read_bytes()
    r = run_in(repro_cmd("redact", str(odd), str(png)), tmp_path)
    no_traceback(r)
    assert r.returncode == 0 and "redacted 1 file(s)" in r.stdout, r.stderr
    assert odd.read_bytes() == b"\x89 start\r\nlog at <repo>/scratch/x.log\r\n\xff\xfe \xc3 end\r\n"
    assert png.read_bytes() == before
