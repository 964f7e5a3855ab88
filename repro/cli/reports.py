"""`python -m repro doctor | agree | bench | xdist-report | redact | records`: what a machine can run, and reports over
recorded results."""

from __future__ import annotations

import argparse
import contextlib
import lzma
import os
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from repro import exit_codes
from repro.cli.common import check_exists
from repro.cli.doctor import doctor
from repro.cli.outputs import check_file, markdown_of
from repro.errors import ConfigError
from repro.files import write_whole
from repro.report.benchmark import benchmark_markdown, paths_from_files
from repro.report.redact import redact, redact_tree
from repro.report.results import MODEL, is_vllm_gate_record, load_json
from repro.report.xdist import check_junit
from repro.report.xdist import markdown as junit_markdown


def add_parsers(sub) -> None:
    sub.add_parser("doctor", help="what this machine can run, and how to fix what is missing")
    g = sub.add_parser("agree", help="the CPU model's verdicts against recorded GPU results (results.json ...)")
    g.add_argument(
        "results", nargs="+", help="results.json files written by matrix (GPU runs; predictions are left out)"
    )
    g.add_argument("--out", help="write the Markdown here (default: print it only)")
    x = sub.add_parser("xdist-report", help="check from a JUnit XML that each xdist worker had a GPU of its own")
    x.add_argument("junit", help="JUnit XML of a pytest -n N -m gpu run (--junitxml)")
    x.add_argument("--workers", type=int, help="number of workers expected, at least 1 (default: any number)")
    x.add_argument("--out", help="write the Markdown here (default: print it only)")
    rd = sub.add_parser("redact", help="replace machine paths in recorded results with <repo>/, <path>/ ...")
    rd.add_argument("paths", nargs="+", help="files or folders to rewrite in place")
    b = sub.add_parser(
        "bench",
        help="benchmark numbers from recorded matrix runs (results.json): a plain and a memcheck run, or with --paths "
        "the old and the new execution path of one matrix (to run both paths now: matrix --compare-executors)",
    )
    b.add_argument("plain", nargs="?", help="results.json of a matrix run without the sanitizer")
    b.add_argument("memcheck", nargs="?", help="results.json of the same matrix under memcheck (--sanitizer)")
    b.add_argument("--paths", nargs=2, metavar=("OLD", "NEW"), help="results.json of the old path, then the new")
    b.add_argument("--out", help="write the Markdown here (default: print it only)")
    r = sub.add_parser(
        "records",
        help="the recorded runs under results/: pack and index a new one (--add), rewrite the index (--index), list the "
        "README's GPU commands whose last record ran older code (--stale), unpack them all (--unpack DIR), compare gate "
        "speed records (--speed)",
    )
    act = r.add_mutually_exclusive_group(required=True)
    act.add_argument(
        "--add", nargs="+", metavar="NAME", help="pack results/NAME/ into results/NAME.tar.xz and index it"
    )
    act.add_argument("--index", action="store_true", help="write results/index.json from the records and git")
    act.add_argument("--stale", action="store_true", help="exit 1 when a README GPU command's last record is stale")
    act.add_argument("--unpack", metavar="DIR", help="write every record, unpacked, under DIR/results/")
    act.add_argument(
        "--speed",
        nargs="+",
        metavar="NAME",
        help="gate runs and path comparisons side by side, one table: outcome, wall, median seconds per phase (a "
        "benchmark against its previous record: give both)",
    )
    r.add_argument(
        "--timeline",
        action="store_true",
        help="with --speed: each gate record's whole run too: every process's start, end and phases, the concurrency, "
        "idle slots, the critical path, retries and references",
    )
    r.add_argument("--note", help="with --add: one line of what the record shows, kept in its index entry")
    r.add_argument("--root", default=".", help="the checkout whose results/ to read (default: this folder)")
    sub.choices["doctor"].set_defaults(func=cmd_doctor)
    sub.choices["records"].set_defaults(func=cmd_records)
    sub.choices["agree"].set_defaults(func=cmd_agree)
    sub.choices["bench"].set_defaults(func=cmd_bench)
    sub.choices["xdist-report"].set_defaults(func=cmd_xdist)
    sub.choices["redact"].set_defaults(func=cmd_redact)


def cmd_doctor(a: argparse.Namespace) -> int:

    doctor(say=lambda line: print(line, flush=True))  # each line as it is known
    return exit_codes.Exit.OK


def _each_once(given: list[str], command: str) -> None:
    """ConfigError for a record named twice (the same file however written): its cases would count twice."""
    seen: dict[object, str] = {}
    for g in given:
        try:
            st = os.stat(g)
            real: object = (st.st_dev, st.st_ino)  # a hard link to a record is that record
        except OSError:
            real = os.path.realpath(g)
        if real in seen:
            raise ConfigError(f"{command}: {seen[real]} and {g} are one record: each case would count twice")
        seen[real] = g


def cmd_agree(a: argparse.Namespace) -> int:
    from repro.report.agreement import compare, markdown  # the CPU model (numpy): for agree only

    for p in a.results:
        check_exists(p)
    check_file(a.out, "--out", inputs=tuple(a.results), own=markdown_of("# CPU model against the H200"))
    gate_runs = [p for p in a.results if is_vllm_gate_record(p)]
    given = [p for p in a.results if p not in gate_runs]
    runs = {p: load_json(p) for p in given}  # one line, exit 2, for anything that is not a results.json
    measured = [p for p, run in runs.items() if run.source != MODEL]
    predicted = [p for p in given if p not in measured]
    for what, left in (
        ("real-vLLM gate record(s) (no attention-layer cases)", gate_runs),
        ("file(s) of CPU-model predictions, not GPU verdicts", predicted),
    ):
        if left:  # one line per kind, however many files
            names = ", ".join(map(str, left[:3])) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
            print(f"note: {len(left)} {what} left out: {names}", file=sys.stderr)
    if not measured:
        raise ConfigError("no GPU run to compare with: give results.json files of GPU runs (e.g. results/h200-*/)")
    _each_once(measured, "agree")  # the runs compared: a record left out (a note) may be named again
    rows = []
    for i, p in enumerate(measured, 1):  # the model predicts every case of a file: seconds each
        rows += compare([p])
        print(f"[agree] {i}/{len(measured)} {p}: {len(rows)} case(s) compared so far", file=sys.stderr, flush=True)
    if not rows:  # 0 of 0 agree is no answer, never "every verdict agrees"
        raise ConfigError(
            f"no case of {', '.join(measured)} can be compared with the CPU model (it predicts eager v2-capture cases "
            "at sm_margin, MPS or the full GPU, and the GPU gave no verdict or none of those ran): nothing written"
        )
    md = markdown(rows, measured)
    if a.out:
        write_whole(a.out, redact(md))
    print(md)
    return exit_codes.check(all(r.verdict_agrees for r in rows))


BENCH_HEADINGS = ("# Benchmark: the default matrix", "## Case execution paths, side by side on one matrix")


def cmd_bench(a: argparse.Namespace) -> int:

    given = [p for p in (a.plain, a.memcheck) if p]
    if bool(a.paths) == bool(given) or (given and len(given) != 2):
        raise ConfigError("give two results.json (PLAIN MEMCHECK) or --paths OLD NEW, one of the two")
    for path in a.paths or given:
        check_exists(path)
    check_file(a.out, "--out", inputs=tuple(a.paths or given), own=markdown_of(*BENCH_HEADINGS))
    md = paths_from_files(*a.paths) if a.paths else benchmark_markdown(a.plain, a.memcheck)
    if a.out:
        write_whole(a.out, redact(md))
    print(md)
    return exit_codes.Exit.OK


def cmd_xdist(a: argparse.Namespace) -> int:

    if a.workers is not None and a.workers < 1:
        raise ConfigError(f"--workers must be at least 1, got {a.workers}")
    check_exists(a.junit)
    check_file(a.out, "--out", inputs=(a.junit,), own=markdown_of("# xdist pinning: "))
    rep = check_junit(a.junit, a.workers)
    if not rep.workers:  # nothing to check is no answer (as agree's comparison of nothing), never a report
        raise ConfigError(
            f"{a.junit}: no case recorded the GPU it ran on: nothing to check (the JUnit XML of a `pytest -n N -m gpu` "
            "run on a GPU machine, whose cases ran)"
        )
    md = junit_markdown(rep, a.junit)
    if a.out:
        write_whole(a.out, redact(md))
    print(md)
    return exit_codes.check(rep.ok)


def cmd_redact(a: argparse.Namespace) -> int:

    for path in a.paths:
        check_exists(path)
    changed = redact_tree(a.paths)
    print(f"redacted {len(changed)} file(s)")
    return exit_codes.Exit.OK


def cmd_records(a: argparse.Namespace) -> int:
    from repro.report import records, records_add, stale  # git and tar: for this command only

    root = Path(a.root)
    results = root / "results"
    if not results.is_dir():
        raise ConfigError(f"{results} is not a folder: give --root the checkout that holds results/")
    if a.note and not a.add:
        raise ConfigError("--note goes with --add")
    if a.timeline and not a.speed:
        raise ConfigError("--timeline goes with --speed")
    if a.stale or a.add or a.index:  # they read the index as written: a damaged one is never blamed on a record
        try:
            records.load_index(results)
        except UNREADABLE as e:
            raise ConfigError(
                f"{results / records.INDEX} cannot be read ({type(e).__name__}: {e}): restore it (git checkout) or "
                "remove it to rebuild it from the records and git (its notes are lost); nothing packed or written"
            ) from None
    if a.stale:
        if not records.git(root, "rev-parse", "HEAD"):
            raise ConfigError(f"{root} is not a git checkout with history: --stale compares commits")
        found = stale.check(root)
        if not found:  # nothing checked is no answer, never "every record fresh"
            raise ConfigError(
                f"{root / 'README.md'} shows none of the GPU commands --stale checks: give --root this "
                "project's checkout"
            )
        for s in found:
            print(s.line())
        return exit_codes.check(not any(s.stale for s in found))
    if a.speed:
        return _speed(results, a.speed, a.timeline)
    if a.unpack is not None:
        if not a.unpack.strip():  # '' is this folder to Path, never a folder the user named
            raise ConfigError("--unpack '': give the folder to write results/ into")
        return _unpack(results, Path(a.unpack))
    names = list(dict.fromkeys(a.add or []))
    for name in names:
        if name not in records.records(results):
            raise ConfigError(f"no record results/{name}/ (or {name}{records.PACKED}) to add")
        if (results / name).is_dir() and (results / f"{name}{records.PACKED}").exists():
            raise ConfigError(
                f"results/{name}/ and results/{name}{records.PACKED} both exist: --add would replace the packed "
                "record without a word; give the new record another name, or remove the archive first (git rm)"
            )
        if (results / name).is_dir() and (link := records.first_link(results / name)):
            raise ConfigError(
                f"{link}: a symbolic link: a record holds files only (its target would be packed); nothing packed"
            )
    described = {}  # each record read once, the index built once from them, before anything is packed or written
    for name, where in records.records(results).items():  # a damaged one: refused before any packing
        try:
            described[name] = records.describe(records.members(where, records.indexed))
        except UNREADABLE as e:
            raise ConfigError(
                f"results/{name}: cannot be read ({type(e).__name__}: {e}); nothing packed or written"
            ) from None
    try:  # the records git history holds too (a damaged one there: refused before anything is packed)
        notes = dict.fromkeys(names, a.note) if a.note else {}
        index = records.build_index(root, notes, described, {n for n in names if (results / n).is_dir()})
    except UNREADABLE as e:
        raise ConfigError(
            f"a record in git history cannot be read ({type(e).__name__}: {e}); nothing written"
        ) from None
    *archives, written = records_add.add(root, names, index)  # every archive and the index in place, or none of them
    for path in archives:
        print(f"packed {path}")
    print(f"wrote {written}")
    return exit_codes.Exit.OK


# what a damaged record raises when read: a truncated or corrupt archive, a summary that is not JSON or not its shape
UNREADABLE = (tarfile.TarError, EOFError, lzma.LZMAError, OSError, ValueError, KeyError, TypeError, AttributeError)


def _unpack(results: Path, top: Path) -> int:
    """`records --unpack DIR`: every record under DIR/results/, a new or empty folder, written whole or not at all
    (unpacked beside it first, then renamed into place); a damaged record is refused, nothing left behind."""
    from repro.report import records  # as above

    dest = top / "results"
    for p in (top, dest):
        if p.exists() and not p.is_dir():
            raise ConfigError(f"--unpack {top}: {p} exists and is not a folder")
    if dest.is_dir() and any(dest.iterdir()):
        raise ConfigError(f"--unpack {top}: {dest} holds files: give a folder without a non-empty results/")
    found = records.records(results)  # before the staging folder exists (DIR may lie under results/)
    made = [d for d in [top.absolute(), *top.absolute().parents] if not d.exists()]
    try:
        top.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".results-", dir=top))
        staging.chmod(0o755)  # as a folder made plainly
    except OSError as e:
        raise ConfigError(f"--unpack {top}: cannot write there ({e.strerror or e})") from None
    try:
        for name, where in found.items():
            try:
                if where.is_dir():
                    shutil.copytree(where, staging / name)
                else:
                    records.unpack(where, staging)
            except UNREADABLE as e:
                raise ConfigError(
                    f"results/{name}: cannot be unpacked ({type(e).__name__}: {e}); nothing written"
                ) from None
        staging.replace(dest)  # an empty dest is replaced
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        for d in made:  # the folders made for it, the deepest first, while empty
            with contextlib.suppress(OSError):
                d.rmdir()
        raise
    print(f"unpacked {len(found)} record(s) under {dest}")
    return exit_codes.Exit.OK


def _speed(results: Path, names: list[str], timeline: bool = False) -> int:
    """`records --speed`: each named record unpacked into a temporary folder (never beside the records), its rows;
    `--timeline`: each gate run's whole timeline after the table (gate.timeline)."""
    from repro.report import records  # as above
    from repro.vllm_integration.gate import order as gate_order  # as above
    from repro.vllm_integration.gate import speed  # as above
    from repro.vllm_integration.gate import timeline as gate_timeline  # as above

    _each_once(names, "records --speed")
    found = records.records(results)
    if missing := [n for n in names if n not in found]:
        raise ConfigError(f"no record {', '.join(missing)} under {results}")
    rows, timelines = [], []
    with tempfile.TemporaryDirectory(prefix="repro-speed-") as tmp:
        for name in names:
            where = found[name]
            try:
                folder = where if where.is_dir() else records.unpack(where, Path(tmp))
                rows += speed.record_rows(name, Path(folder))
                if timeline:
                    timelines.append(_timeline(gate_timeline, gate_order, name, Path(folder)))
            except UNREADABLE as e:
                raise ConfigError(f"--speed {name}: {e or type(e).__name__}") from None
    print(speed.speed_table(rows), end="")
    for t in timelines:
        print("\n" + t, end="")
    return exit_codes.Exit.OK


def _timeline(gate_timeline, gate_order, name: str, folder: Path) -> str:
    """One record's timeline and what this scheduler makes of its processes (simulated), or the line that says why
    it has none (a path comparison, or rows without starts)."""
    if not (folder / "results.json").exists():
        return f"## {name}: no timeline (not one gate run: a path comparison)\n"
    try:
        tl = gate_timeline.load(folder)
    except ValueError as e:
        return f"## {name}: no timeline ({e})\n"
    after = gate_timeline.profile(tl)["after_last"]
    return gate_timeline.markdown(name, tl) + "\n" + "\n".join(gate_order.prediction_lines(name, tl, after))
