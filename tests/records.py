"""The recorded runs the tests read (results/; not collected: no test_ prefix). A record is packed (NAME.tar.xz) or a
folder not packed yet (a new one: `python -m repro records --add NAME` packs and indexes it); either way a test gets a
folder: `RESULTS / NAME`, unpacked once per test session (per xdist worker) into one temporary folder that mirrors
results/, and `load(path)` parses a JSON file of it once per session (the same object every time: read it, never
change it). results/'s own files (README.md, model-agreement.md, the source check's JSON) are read in place."""

from __future__ import annotations

import atexit
import fnmatch
import functools
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from repro.report.records import NOT_RECORDS, records, unpack

ROOT = Path(__file__).resolve().parent.parent


@functools.cache
def unpacked() -> Path:
    """The session's folder holding results/NAME for every record: unpacked archives, and links to the folders not
    packed yet (so `results/NAME/...` names the same file from it, as `agree` and the summaries name them)."""
    top = Path(tempfile.mkdtemp(prefix="repro-records-"))
    atexit.register(shutil.rmtree, top, ignore_errors=True)
    (top / "results").mkdir()
    return top


@functools.cache
def _stored(results: Path) -> dict[str, Path]:
    return records(results)


@functools.cache
def folder(name: str, results: Path = ROOT / "results") -> Path:
    """The record's folder, unpacked on first use."""
    where = _stored(results).get(name)
    if where is None:
        raise FileNotFoundError(f"no record results/{name} (packed or a folder): see results/index.json")
    dest = unpacked() / "results"
    if results != ROOT / "results":  # another results/ (a test's): its own folder in the session's one
        dest = unpacked() / str(abs(hash(results))) / "results"
        dest.mkdir(parents=True, exist_ok=True)
    if where.is_dir():
        (dest / name).symlink_to(where, target_is_directory=True)
        return dest / name
    return unpack(where, dest)


@functools.cache
def load(path: Path) -> dict:
    """A JSON file of a record, parsed once per session."""
    return json.loads(Path(path).read_text())


class Results:
    """results/ as the tests read it: `RESULTS / NAME` a record's folder (unpacked) or results/'s own file,
    `glob("*/results.json")` and `iterdir()` over every record."""

    def __init__(self, root: Path):
        self.root = root

    def __truediv__(self, name: str) -> Path:
        own = self.root / name
        if own.is_file() or name in NOT_RECORDS:
            return own
        record, _, inside = name.partition("/")  # "NAME/sub" as well as "NAME"
        return folder(record, self.root) / inside if inside else folder(record, self.root)

    def names(self) -> list[str]:
        return sorted(_stored(self.root))

    def iterdir(self) -> Iterator[Path]:
        return (folder(n, self.root) for n in self.names())

    def glob(self, pattern: str) -> Iterator[Path]:
        first, _, rest = pattern.partition("/")
        for name in self.names():
            if fnmatch.fnmatch(name, first):
                yield from (folder(name, self.root).glob(rest) if rest else [folder(name, self.root)])


RESULTS = Results(ROOT / "results")
