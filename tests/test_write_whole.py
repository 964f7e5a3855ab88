"""A file written whole or not at all (repro/files.py), the one helper every layer writes such a file through: its
mode (kept, or the umask's default for a new file, never mkstemp's 0600), its flush before the rename, no temporary
left on any exception, links replaced or written through as asked; and no module writing one its own way."""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

from repro.errors import ConfigError
from repro.files import replacing, write_whole
from tests.commands import main_in

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    try:
        yield 0o640
    finally:
        os.umask(old)


def _mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def test_a_new_file_written_whole_gets_the_umasks_default_mode_as_open_gives(tmp_path, umask_027):
    write_whole(tmp_path / "new.json", "{}\n")
    with open(tmp_path / "opened.json", "w"):
        pass
    assert _mode(tmp_path / "new.json") == _mode(tmp_path / "opened.json") == umask_027


def test_a_file_written_whole_keeps_the_mode_of_the_file_it_replaces(tmp_path, umask_027):
    f = tmp_path / "kept.md"
    f.write_text("old\n")
    f.chmod(0o604)
    write_whole(f, b"new\n")
    assert f.read_bytes() == b"new\n" and _mode(f) == 0o604


def test_a_file_written_whole_is_flushed_to_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    calls = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (calls.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda a, b: (calls.append("replace"), real_replace(a, b))[1])
    write_whole(tmp_path / "f.txt", "x")
    assert calls == ["fsync", "replace"] and (tmp_path / "f.txt").read_text() == "x"


@pytest.mark.parametrize("raised", [KeyboardInterrupt, OSError, ValueError])
def test_a_file_written_whole_leaves_no_temporary_and_the_old_file_on_any_exception(tmp_path, raised):
    f = tmp_path / "f.json"
    f.write_text("old")
    with pytest.raises(raised):
        with replacing(f) as tmp:
            tmp.write_text("half")
            raise raised()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"] and f.read_text() == "old"


def test_a_file_written_whole_leaves_no_temporary_when_the_rename_is_interrupted(tmp_path, monkeypatch):
    def interrupted(*_):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_whole(tmp_path / "f.json", "new")
    assert list(tmp_path.iterdir()) == []


def test_a_link_is_refused_and_kept_never_replaced_nor_written_through(tmp_path, umask_027):
    target = tmp_path / "target.md"
    target.write_text("target\n")
    (tmp_path / "link.md").symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        write_whole(tmp_path / "link.md", "replaced\n")
    assert (tmp_path / "link.md").is_symlink() and target.read_text() == "target\n"


def test_a_report_file_a_command_writes_gets_the_umasks_default_mode_not_0600_or_keeps_its_own(tmp_path, umask_027):
    """Through a command (`matrix --json`, the CPU model's prediction; cli/outputs.py's checks): a new report file is
    as open() would make it, an existing one keeps its mode."""
    out = tmp_path / "m.json"
    args = ["matrix", "--json", str(out), "--model-sms", "16"]
    assert main_in(args, tmp_path).returncode == 0
    assert _mode(out) == umask_027
    out.chmod(0o604)
    assert main_in(args, tmp_path).returncode == 0
    assert _mode(out) == 0o604


# the renames that are no file written whole: own_alloc's compiler output renamed into place (nvcc writes the file)
OWN_RENAMES = {"repro/run/own_alloc.py"}


def _renames(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if name in ("replace", "rename") and ast.unparse(node.func.value) == "os":
                found.append(ast.unparse(node))
            elif name in ("mkstemp", "NamedTemporaryFile") and ast.unparse(node.func.value) == "tempfile":
                found.append(ast.unparse(node))
    return found


def test_every_file_written_whole_goes_through_the_one_helper():
    """No module of repro/ renames a temporary of its own into place (os.replace, os.rename, tempfile.mkstemp) but
    repro/files.py and the renames that are not one file written whole (OWN_RENAMES)."""
    own = {}
    for p in sorted((ROOT / "repro").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel != "repro/files.py" and rel not in OWN_RENAMES and (found := _renames(p)):
            own[rel] = found
    assert not own, own
    assert all(_renames(ROOT / rel) for rel in OWN_RENAMES), "a rename listed in OWN_RENAMES is gone: drop it"


def test_a_file_written_whole_is_fsynced_unless_asked_not_to_be(tmp_path, monkeypatch):
    """The audit file's snapshots (plugin audit_file.merge_into) must outlive their writer's kill, not the machine's:
    `durable=False` skips the fsync, and only that."""
    synced: list[int] = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd))
    write_whole(tmp_path / "a", "x")
    assert len(synced) == 1
    write_whole(tmp_path / "b", "y", durable=False)
    assert len(synced) == 1 and (tmp_path / "b").read_text() == "y"
