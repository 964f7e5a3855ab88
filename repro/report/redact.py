"""Keeps machine paths out of what the harness records: every absolute path becomes `<repo>/…` (this project's
files), `<site-packages>/…` (installed packages) or `<path>/basename`. Applied when reports are written, and by
`python -m repro redact FILES…` to records written before this existed (verdicts and numbers are untouched)."""

from __future__ import annotations

import re
from pathlib import Path

PROJECT_DIRS = {"repro", "cases", "tests", "results", ".gpu", "scratch", ".ci"}
_PATH = re.compile(
    r"(?<!<repo>)(?<!<path>)(?<!<site-packages>)(?:(?<=^)|(?<=[\s\"'(=:`\[,>@]))/(?:[\w.+-]+/)+[\w.+-]*", re.M
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


def redact_file(path: str | Path) -> bool:
    """Rewrite one record in place; True when something changed. Only the paths change: every other byte stays as
    it was (bytes that are not UTF-8 pass through, line endings are kept), and a binary file (one with a NUL byte,
    such as a PNG) is left untouched."""
    p = Path(path)
    data = p.read_bytes()
    if b"\0" in data:
        return False
    text = data.decode("utf-8", "surrogateescape")
    new = redact(text, xml=p.suffix == ".xml")
    if new != text:
        p.write_bytes(new.encode("utf-8", "surrogateescape"))
    return new != text


def redact_tree(paths: list[str | Path]) -> list[Path]:
    changed = []
    for root in map(Path, paths):
        files = [root] if root.is_file() else sorted(f for f in root.rglob("*") if f.suffix in SUFFIXES)
        changed += [f for f in files if redact_file(f)]
    return changed
