"""Keeps machine paths out of what the harness records: every absolute path becomes `<repo>/…` (this project's
files), `<site-packages>/…` (installed packages) or `<path>/basename`. Applied when reports are written, and by
`python -m repro redact FILES…` to records written before this existed (verdicts and numbers are untouched)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from repro.errors import ConfigError
from repro.files import read_bounded, write_whole

PROJECT_DIRS = {"repro", "cases", "tests", "results", ".gpu", "scratch", ".ci"}
# (?=/) first: the lookbehinds are tried only where a path can start (the same matches, a scan several times faster)
_PATH = re.compile(
    r"(?=/)(?<!<repo>)(?<!<path>)(?<!<site-packages>)(?:(?<=^)|(?<=[\s\"'(=:`\[,>@]))/(?:[\w.+-]+/)+[\w.+-]*", re.M
)
SUFFIXES = (".json", ".md", ".xml", ".txt", ".log")


def _one(m: re.Match) -> str:
    path = m.group(0)
    parts = path.strip("/").split("/")
    if "site-packages" in parts:
        return "<site-packages>/" + "/".join(parts[parts.index("site-packages") + 1 :])
    for i, p in enumerate(parts):
        if p in PROJECT_DIRS and i > 0:
            return "<repo>/" + "/".join(parts[i:])
    return "<path>/" + parts[-1] if parts[-1] else "<path>/"


def redact(text: str, xml: bool = False) -> str:
    """Paths replaced; in XML (JUnit) the markers are escaped so the file stays well-formed."""
    if xml:
        for marker in ("repo", "path", "site-packages"):  # markers an earlier redaction wrote unescaped
            text = text.replace(f"<{marker}>/", f"&lt;{marker}&gt;/")
        return _PATH.sub(lambda m: _one(m).replace("<", "&lt;").replace(">", "&gt;"), text)
    return _PATH.sub(_one, text)


def _redacted(p: Path) -> bytes | None:
    """The bytes `p` should hold, or None when they stay as they are. Only the paths change: every other byte stays
    as it was (bytes that are not UTF-8 pass through, line endings are kept), and a binary file (one with a NUL
    byte, such as a PNG) is left untouched."""
    try:
        data = read_bounded(p)  # a regular file of bounded size
    except ConfigError as e:
        raise ConfigError(f"{e}; nothing was rewritten") from None
    if b"\0" in data:
        return None
    text = data.decode("utf-8", "surrogateescape")
    new = redact(text, xml=p.suffix == ".xml")
    return None if new == text else new.encode("utf-8", "surrogateescape")


def redact_file(path: str | Path) -> bool:
    """Rewrite one record in place (see _redacted); True when something changed."""
    p = Path(path)
    new = _redacted(p)
    if new is not None:
        write_whole(p, new)  # a link there is refused, never written through
    return new is not None


def _files(root: Path) -> list[Path]:
    """The records under a folder, never through a symbolic link (to a file or a folder: it may lead out of it)."""
    found = []
    for folder, _, names in os.walk(root):  # os.walk does not enter linked folders
        found += [Path(folder, n) for n in names if Path(n).suffix in SUFFIXES and not Path(folder, n).is_symlink()]
    return sorted(found)


def redact_tree(paths: list[str | Path]) -> list[Path]:
    """Every record named, or under a folder named (links not followed), rewritten; ConfigError, before any file
    is rewritten, when one that would change cannot be read or written."""
    todo = []
    if any(not str(given).strip() for given in paths):  # '' is this folder to Path, never a record the user named
        raise ConfigError("redact '': name the records' files or folder; nothing was rewritten")
    for root in map(Path, paths):
        if root.is_symlink():  # it may lead anywhere: never followed, to a file or a folder
            raise ConfigError(f"{root}: is a symbolic link, which redact never follows; nothing was rewritten")
        if not root.is_file() and not root.is_dir():  # a device, a fifo: no record
            raise ConfigError(f"{root}: neither a file nor a folder of records; nothing was rewritten")
        for f in [root] if root.is_file() else _files(root):
            new = _redacted(f)
            if new is not None:
                todo.append((f, new))
    for f, _ in todo:  # each is written beside itself, then renamed: its folder must take a new file
        if not os.access(f, os.W_OK) or not os.access(f.absolute().parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{f}: cannot write it (permission denied); nothing was rewritten")
    for f, new in todo:
        try:
            write_whole(f, new)
        except OSError as e:
            raise ConfigError(f"{f}: cannot write it ({e.strerror or e})") from None
    return [f for f, _ in todo]
