"""Where a command may write, in one place (docs/outputs.md): a command writes only where it was told to (its --out
folder, its --json or --out file, else a new folder under the temp folder), never destroys an input, and leaves
nothing half-done after Ctrl-C or a refusal.

- A report folder (`--out` of run, matrix, gate) must be new or empty; one that holds a report already (of this
  command or another) is refused unless `--overwrite` is given, which empties a report folder first and never one
  that holds anything else. While a command writes, the folder's MARKER holds a lock: a second command given the same
  folder is refused, `--overwrite` or not.
- Stopped before it finished (Ctrl-C, a refusal, an error): a folder that received nothing is removed again, with
  the parent folders the command made for it (an empty folder the user gave is emptied again, never removed); one
  that holds something gets an INTERRUPTED file saying so.
- A report file (`--json`, `--out FILE`) is a regular file or a new one, never a device node, a fifo, a folder or a
  symbolic link (repro.files.check_target, which every write goes through too), never one of the command's inputs (a
  hard link to one included); an existing one is replaced only when it is a report of the command's own kind (its
  JSON, or its Markdown's own first line), and it is written whole or not at all (repro.files: a temporary file
  renamed into place).
- A git checkout (`bisect`) is given back as it was, on any exit: a bisect the user has in progress is refused, one
  `repro bisect` at a time per checkout.

repro.cli.main calls `finish()` when a command returns and `abandon()` when it stops otherwise."""

from __future__ import annotations

import codecs
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from repro.errors import ConfigError
from repro.files import check_target, read_bounded
from repro.files import loads as json_loads

MARKER = ".repro-report.json"  # {"command", "pid", "started", "state"}: which command wrote this folder, and how far
INTERRUPTED = "INTERRUPTED"
REPORT_FILES = (MARKER, "verdicts.md", "results.json", "paths.md", "executors.md", INTERRUPTED)
OVERWRITE_HELP = "replace the report an earlier run left in --out (default: refuse a folder that is not empty)"


def _locked_by_other(marker: Path) -> bool:
    try:
        fd = os.open(marker, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # closing drops a lock taken here
    return False


def _writer(marker: Path) -> str:
    try:
        facts = json.loads(marker.read_text())
        return f"`{facts['command']}` (pid {facts['pid']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another command"


def check_folder(path: str | None, overwrite: bool = False, flag: str = "--out") -> None:
    """Before any work: ConfigError when the folder cannot be a report folder of this command (see the module).
    Leaves nothing behind."""
    if path is None:
        return
    if not path.strip():  # '' is this folder to Path, never a folder the user named
        raise ConfigError(f"{flag} '': give a folder name")
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path}: exists and is not a folder")
    if p.is_dir() and any(p.iterdir()):
        if _locked_by_other(p / MARKER):
            raise ConfigError(f"{flag} {path}: {_writer(p / MARKER)} is writing into it now: give another folder")
        is_report = any((p / name).exists() for name in REPORT_FILES)
        if not overwrite:
            what = "a report of an earlier run" if is_report else "files"
            raise ConfigError(f"{flag} {path}: holds {what}: give a new or empty folder, or --overwrite to replace it")
        if not is_report:
            raise ConfigError(
                f"{flag} {path}: holds files that are not a repro report: --overwrite replaces only a report "
                "folder; give a new or empty folder"
            )
    check_writable(p, path, flag)


def check_inputs_kept(path: str | None, overwrite: bool, inputs: list[str | None], flag: str = "--out") -> None:
    """With --overwrite, before any work: ConfigError when one of the command's inputs (a build, a cache) lies in the
    report folder that --overwrite would empty."""
    if path is None or not overwrite or not Path(path).is_dir():
        return
    p = Path(path).resolve()
    for given in filter(None, inputs):
        if p == Path(given).resolve() or p in Path(given).resolve().parents:
            raise ConfigError(
                f"{flag} {path}: holds {given}, an input of this command, which --overwrite would remove: give "
                "another folder"
            )


class ReportFolder:
    """A folder a command is writing its report into, with the lock on its MARKER."""

    def __init__(self, path: Path, made: list[Path], command: str, existed: bool = False):
        self.path, self.made, self.command, self.started = path, made, command, time.time()
        self.existed = existed  # the user's own (empty) folder: emptied again, never removed
        self.fd = os.open(path / MARKER, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(self.fd)
            raise ConfigError(
                f"--out {path}: {_writer(path / MARKER)} is writing into it now: give another folder"
            ) from None
        self._state("running")

    def _state(self, state: str) -> None:
        doc = {"command": self.command, "pid": os.getpid(), "started": self.started, "state": state}
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, (json.dumps(doc) + "\n").encode(), 0)

    def close(self, why: str | None) -> None:
        """Done (why None), or stopped for `why`: an empty folder removed, else marked INTERRUPTED."""
        try:
            if why is None:
                self._state("complete")
                with contextlib.suppress(FileNotFoundError):
                    (self.path / INTERRUPTED).unlink()
                return
            if all(f.name == MARKER for f in self.path.rglob("*") if not f.is_dir()):
                if self.existed:
                    for entry in self.path.iterdir():
                        shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()
                    return
                shutil.rmtree(self.path, ignore_errors=True)
                for d in self.made:  # the parents made for it, the deepest first, while empty
                    with contextlib.suppress(OSError):
                        d.rmdir()
                return
            self._state("interrupted")
            (self.path / INTERRUPTED).write_text(
                f"`{self.command}` stopped before it finished ({why}): the reports here are partial or missing.\n"
            )
        finally:
            os.close(self.fd)


_OPEN: list[ReportFolder] = []


def open_folder(path: str | None, command: str, overwrite: bool = False) -> Path:
    """The report folder of `command`: the one asked for (made, or emptied with --overwrite after check_folder), or
    a new one under the temp folder; locked, and closed by finish() or abandon()."""
    existed = False
    if path is None:
        out, made = Path(tempfile.mkdtemp(prefix=f"repro-{command}-")), []
    else:
        out = Path(path)
        existed = out.is_dir()
        made = [d for d in [out.absolute(), *out.absolute().parents] if not d.exists()][1:]
        if out.is_dir() and overwrite and not _locked_by_other(out / MARKER):
            for entry in out.iterdir():  # a report folder (check_folder): its entries, never through a link
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"--out {path}: cannot create it ({e.strerror or e})") from None
    _OPEN.append(ReportFolder(out, made, command, existed))
    return out


def finish() -> None:
    """The command returned: its folders are complete."""
    while _OPEN:
        _OPEN.pop().close(None)


def abandon(why: str) -> None:
    """The command stopped before it finished: see ReportFolder.close."""
    while _OPEN:
        _OPEN.pop().close(why)


def _same(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def is_text(path: Path) -> bool:
    """A file of text (what a Markdown report is): no NUL byte, UTF-8, in its first MiB."""
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 20)
        codecs.getincrementaldecoder("utf-8")().decode(head, final=len(head) < 1 << 20)
    except (OSError, UnicodeDecodeError):
        return False
    return b"\0" not in head


def json_of(check: Callable[[object], bool]) -> Callable[[Path], bool]:
    """A report-kind test for JSON reports: the file parses, and `check` accepts the document."""

    def own(path: Path) -> bool:
        try:
            return bool(check(json_loads(read_bounded(path))))
        except (OSError, ValueError, UnicodeDecodeError, TypeError, KeyError, AttributeError):
            return False  # ConfigError (too large, too deep, not JSON) is a ValueError: not a report of this kind

    return own


def markdown_of(*headings: str) -> Callable[[Path], bool]:
    """A report-kind test for Markdown reports: text whose first line starts with one of the command's own
    headings (any other text file, a README or a copy of a source file, is not one)."""

    def own(path: Path) -> bool:
        if not is_text(path):
            return False
        with open(path, "rb") as f:
            first = f.readline(4096).decode("utf-8", "replace")
        return first.startswith(headings)

    return own


def check_file(
    path: str | None, flag: str = "--json", inputs: tuple[str, ...] = (), own: Callable[[Path], bool] = is_text
) -> None:
    """Before any work: ConfigError when the report file is a folder, one of the inputs, an existing file that is no
    report of this kind (`own`), or cannot be written. Leaves nothing behind."""
    if path is None:
        return
    if not path.strip():
        raise ConfigError(f"{flag} '': give a file name")
    p = Path(path)
    check_target(p, path, flag)  # a link, a device, a fifo, a folder: refused, kept
    real = os.path.realpath(path)
    for given in inputs:
        if real == os.path.realpath(given) or (p.exists() and os.path.exists(given) and _same(path, given)):
            raise ConfigError(f"{flag} {path}: is one of this command's inputs ({given}): give another file name")
    if p.exists() and not own(p):
        raise ConfigError(
            f"{flag} {path}: exists and is not a report this command writes: give another file name (it is kept)"
        )
    existed = p.exists()
    try:
        with open(p, "a"):
            pass
    except OSError as e:
        raise ConfigError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None
    if not existed:
        p.unlink()


def check_not_the_folders_own(path: str, flag: str, folder: str | None, subfolders: tuple[str, ...] = ()) -> None:
    """ConfigError when a report file given beside a report folder (`--out`) is one of the files the command writes
    into that folder (REPORT_FILES, or anything under its `subfolders`): the one would overwrite the other. Another
    name inside the folder is the user's choice."""
    if folder is None or not folder.strip():
        return
    try:
        rel = Path(os.path.realpath(path)).relative_to(os.path.realpath(folder))
    except ValueError:
        return
    if rel.parts and (rel.parts[0] in REPORT_FILES or rel.parts[0] in subfolders):
        raise ConfigError(f"{flag} {path}: is a file this command writes into {folder}: give another file name")


def _git(repo: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)


@contextlib.contextmanager
def checkout_kept(repo: str) -> Iterator[None]:
    """`bisect`'s checkout, given back as it was on any exit (Ctrl-C and SIGTERM included); ConfigError when a
    bisect is in progress there, its tracked files are changed, or another `repro bisect` runs on it."""
    git_dir = Path(repo, _git(repo, "rev-parse", "--git-dir").stdout.strip())
    lock = os.open(git_dir / "repro-bisect.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(lock)
        raise ConfigError(f"{repo}: another `repro bisect` runs on this checkout now: wait for it") from None
    try:
        if (git_dir / "BISECT_START").exists() or (git_dir / "BISECT_LOG").exists():
            raise ConfigError(
                f"{repo}: a git bisect is in progress there (`git bisect log`): finish it or `git bisect reset` first"
            )
        if _git(repo, "status", "--porcelain", "--untracked-files=no").stdout.strip():
            raise ConfigError(f"{repo}: has changes to tracked files, which bisecting would move: commit or stash them")
        branch = _git(repo, "symbolic-ref", "-q", "--short", "HEAD").stdout.strip()
        head = branch or _git(repo, "rev-parse", "HEAD").stdout.strip()
        term = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM ends it as Ctrl-C does: given back
        try:
            yield
        finally:
            sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C cannot stop the give-back
            try:
                _git(repo, "bisect", "reset", head)
                if (branch and _git(repo, "symbolic-ref", "-q", "--short", "HEAD").stdout.strip() != branch) or (
                    not branch and _git(repo, "rev-parse", "HEAD").stdout.strip() != head
                ):
                    _git(repo, "checkout", "--quiet", head)
            finally:
                signal.signal(signal.SIGINT, sigint)
                signal.signal(signal.SIGTERM, term)
    finally:
        os.close(lock)  # the lock file stays in .git (removing it would let a third run lock another file)


def check_writable(p: Path, path: str, flag: str) -> None:
    """ConfigError when folder `p` (as the user gave it: `path`) cannot be made or written into; a probe that leaves
    nothing behind (the folders it made are removed, the deepest first)."""
    missing = p
    while not missing.parent.exists():
        missing = missing.parent
    try:
        if p.exists():
            with tempfile.TemporaryFile(dir=p):
                pass
        else:
            p.mkdir(parents=True)
            for d in [p, *p.parents]:  # remove what was made, the deepest first
                d.rmdir()
                if d == missing:
                    break
    except OSError as e:
        what = "write into it" if p.exists() else "create it"
        raise ConfigError(f"{flag} {path}: cannot {what} ({e.strerror or e})") from None
