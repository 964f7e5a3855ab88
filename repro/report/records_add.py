"""`records --add` and `--index`: the new records packed and the index written all or nothing into results/ (`add`),
each file renamed into place one after another, each replacement atomic, every one undone on a failure; what the
records and the index are: repro.report.records."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from repro.report.records import INDEX, PACKED, packed


def add(root: Path, names: list[str], index: dict) -> list[Path]:
    """`records --add` and `--index` (no names), all or nothing: each results/NAME/ packed into a hidden temporary
    beside it and the index (built once by the caller, the names `packing`) into another, then each renamed into place,
    one after another (a file there replaced atomically, its hard link kept aside until all are in place: results/
    never lacks it; _rename_all), and only then the folders removed. A failure, Ctrl-C or SIGTERM (raising as Ctrl-C
    does, for the whole add) before the renames leaves results/ as it was: a folder is never gone before its archive and
    its index line are in place. One that arrives during the renames and removals is held until they are done: the add
    completes, says so on stderr, and is not undone. The paths written, the index last."""
    import shutil  # rmtree: only when packing
    import signal  # SIGTERM as Ctrl-C, both held during the renames: only here

    results = Path(root) / "results"
    made: list[Path] = []
    moves: list[tuple[Path, Path]] = []
    held: list[int] = []
    with _handling(signal.SIGTERM, signal.default_int_handler):  # its temporaries removed, not left by a kill
        try:
            for name in names:
                if (results / name).is_dir():
                    made.append(_hidden(results, name + PACKED))
                    made[-1].write_bytes(packed(results / name))
                    moves.append((made[-1], results / (name + PACKED)))
            made.append(_hidden(results, INDEX))
            made[-1].write_text(json.dumps(index, indent=1) + "\n")
            moves.append((made[-1], results / INDEX))
            moves += [(results / name, _hidden(results, name)) for name in names if (results / name).is_dir()]
            hold = lambda signum, frame: held.append(signum)  # noqa: E731
            with _handling(signal.SIGINT, hold), _handling(signal.SIGTERM, hold):
                for p in _rename_all(moves):  # once all are in place: the folders packed, the links kept aside
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
        except BaseException:
            for p in made:  # a temporary renamed into place is no longer there
                p.unlink(missing_ok=True)
            raise
    if held:
        print(f"records: {signal.Signals(held[0]).name} held until every rename was made: done", file=sys.stderr)
    return [dst for _, dst in moves if dst.parent == results and not dst.name.startswith(".")]


@contextlib.contextmanager
def _handling(signum: int, handler: Callable) -> Iterator[None]:
    """signum handled by `handler` inside, its handler restored after (in the main thread: no other runs handlers)."""
    import signal  # as add

    main = threading.current_thread() is threading.main_thread()
    was = signal.signal(signum, handler) if main else handler
    try:
        yield
    finally:
        if main:
            signal.signal(signum, signal.SIG_DFL if was is None else was)


def _hidden(results: Path, name: str) -> Path:
    """A free hidden name beside results/NAME (records() reads no hidden name)."""
    return Path(tempfile.mktemp(prefix=f".{name}.", dir=results))  # a name to rename to, in this user's checkout


def _rename_all(moves: list[tuple[Path, Path]]) -> list[Path]:
    """Each src renamed to its dst, in order, all or none: a dst already there (a file) kept as a hard link aside and
    replaced atomically (never a moment without it); on a failure every rename made is undone, a replaced dst by its
    link. Returns what is removed once all are done: the links kept aside, every dst whose src is gone."""
    done: list[tuple[Path, Path, Path | None]] = []  # (src, dst, the link to what dst was)
    try:
        for src, dst in moves:
            aside = _hidden(dst.parent, dst.name) if dst.exists() else None
            if aside is not None:
                aside.hardlink_to(dst)
            try:
                src.replace(dst)
            except BaseException:
                if aside is not None:
                    aside.unlink()
                raise
            done.append((src, dst, aside))
    except BaseException:
        for src, dst, aside in reversed(done):
            aside.replace(dst) if aside is not None else dst.replace(src)
        raise
    return [p for _, dst, aside in done for p in (aside, dst if dst.name.startswith(".") else None) if p is not None]
