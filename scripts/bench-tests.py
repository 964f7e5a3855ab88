"""The CPU tier's own benchmark: run the README's test command (`python -m pytest -n 2 -q`, with --durations and a
JUnit record), write results/cpu-tier-<date>/ (cpu-tier.json: the command's wall time, the tests' summed time, the
counts, the ten slowest tests, the seconds per test file, and how busy the machine was; cpu-tier.md: the same in a
table), and compare with the previous such record in one table.

    python scripts/bench-tests.py                 # run the tier, record it, compare with the last record
    python scripts/bench-tests.py --compare-only  # the table of the last two records, running nothing
    python scripts/bench-tests.py --name cpu-tier-2026-12-03-quiet   # a record folder of another name

The per-test times come from pytest's JUnit XML (a typed record; setup, call and teardown together), never from the
text pytest prints. Exit status: pytest's."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "results"
PREFIX = "cpu-tier-"
COMMAND = ["-m", "pytest", "-n", "2", "-q", "-p", "no:cacheprovider"]


def _machine() -> dict:
    """What the machine was and how busy it was when the run started."""
    model = ""
    try:
        model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if "model name" in ln
            ),
            "",
        )
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu_model": model, "python": platform.python_version(), "load_1_5_15": None}


def _tests(junit: Path) -> list[dict]:
    """One row per test case of the JUnit record: its node id, file, seconds and outcome."""
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        path = cls.replace(".", "/")
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = child.tag
        file = path.rsplit("/", 1)[0] if "/" in path and path.rsplit("/", 1)[1][:1].isupper() else path
        rows.append(
            {"test": f"{file}.py::{name}", "file": f"{file}.py", "s": float(case.get("time", 0)), "outcome": outcome}
        )
    return rows


def summarize(rows: list[dict], wall_s: float, rc: int, machine: dict, load_after: list[float] | None) -> dict:
    per_file: dict[str, float] = defaultdict(float)
    for r in rows:
        per_file[r["file"]] += r["s"]
    counts: dict[str, int] = defaultdict(int)
    for r in rows:
        counts[r["outcome"]] += 1
    slowest = sorted(rows, key=lambda r: -r["s"])[:10]
    return {
        "kind": "cpu-tier",
        "schema": 1,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(COMMAND),
        "exit_code": rc,
        "wall_s": round(wall_s, 1),
        "tests_s": round(sum(r["s"] for r in rows), 1),
        "counts": dict(sorted(counts.items())),
        "machine": {**machine, "load_after_1_5_15": load_after},
        "slowest": [{"test": r["test"], "s": round(r["s"], 2)} for r in slowest],
        "per_file_s": {f: round(s, 2) for f, s in sorted(per_file.items(), key=lambda kv: -kv[1])},
    }


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        f"# CPU tier, {doc['date']}",
        "",
        f"`{doc['command']}`: exit {doc['exit_code']}, **{doc['wall_s']} s** wall, {doc['tests_s']} s of tests; "
        f"{', '.join(f'{n} {k}' for k, n in doc['counts'].items())}.",
        f"Machine: {m['cpus']} CPUs ({m['cpu_model'] or 'model unknown'}), Python {m['python']}; load average "
        f"(1/5/15 min) {m['load_1_5_15']} at the start, {m['load_after_1_5_15']} at the end.",
        "",
        "| ten slowest tests | s |",
        "|---|---:|",
        *(f"| `{r['test']}` | {r['s']} |" for r in doc["slowest"]),
        "",
        "| file | s |",
        "|---|---:|",
        *(f"| `{f}` | {s} |" for f, s in doc["per_file_s"].items()),
    ]
    return "\n".join(lines) + "\n"


def records() -> list[dict]:
    """The recorded cpu-tier.json documents, oldest first (by the date they hold): a record's folder, or its packed
    NAME.tar.xz (`python -m repro records --add`)."""
    docs = [json.loads((p / "cpu-tier.json").read_text()) for p in RESULTS.glob(PREFIX + "*") if p.is_dir()
            if (p / "cpu-tier.json").is_file()]  # fmt: skip
    for packed in RESULTS.glob(PREFIX + "*.tar.xz"):
        if not (RESULTS / packed.name.removesuffix(".tar.xz")).is_dir():  # a record held both ways: its folder
            with tarfile.open(packed) as tar:
                try:  # a packed folder of that prefix without the document: not a record of this script's
                    member = tar.extractfile(f"{packed.name.removesuffix('.tar.xz')}/cpu-tier.json")
                except KeyError:
                    continue
                docs += [json.loads(member.read())] if member else []
    return sorted(docs, key=lambda d: d["date"])


def compare(old: dict | None, new: dict) -> str:
    """One table: the previous record against this one, the totals, then every file either names (most time first)."""

    def cell(doc, get):
        try:
            return get(doc) if doc else None
        except KeyError:
            return None

    def row(what, get):
        a, b = cell(old, get), cell(new, get)
        if isinstance(a, (int, float)) and isinstance(b, (int, float)) and a:
            change = f"{100 * (b - a) / a:+.0f}%"
        else:
            change = ""
        return f"| {what} | {'' if a is None else a} | {'' if b is None else b} | {change} |"

    head = f"| | {old['date'] if old else '(no previous record)'} | {new['date']} | change |"
    lines = [head, "|---|---:|---:|---:|"]
    lines.append(row("wall (s)", lambda d: d["wall_s"]))
    lines.append(row("tests (s, summed)", lambda d: d["tests_s"]))
    for k in sorted(set(new["counts"]) | set((old or {}).get("counts", {}))):
        lines.append(row(k, lambda d, k=k: d["counts"].get(k, 0)))
    lines.append(row("load at start (1 min)", lambda d: (d["machine"]["load_1_5_15"] or [None])[0]))
    files = dict(new["per_file_s"])
    for f, s in (old or {}).get("per_file_s", {}).items():
        files[f] = max(files.get(f, 0), s)
    for f in sorted(files, key=lambda f: -files[f]):
        lines.append(row(f"`{f}` (s)", lambda d, f=f: d["per_file_s"].get(f, 0)))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench-tests.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--name", help="the record folder under results/ (default: cpu-tier-<UTC date>)")
    p.add_argument("--compare-only", action="store_true", help="print the table of the last two records, run nothing")
    p.add_argument("--durations", type=int, default=10, help="pytest's --durations N (default %(default)s)")
    p.add_argument("--log", type=Path, help="keep pytest's output in this file (default: not kept)")
    a = p.parse_args(argv)
    if a.compare_only:
        docs = records()[-2:]
        if not docs:
            print("no cpu-tier record under results/", file=sys.stderr)
            return 4
        print(compare(docs[0] if len(docs) == 2 else None, docs[-1]), end="")
        return 0
    previous = records()
    name = a.name or PREFIX + datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    out = RESULTS / name
    machine = _machine()
    machine["load_1_5_15"] = [round(x, 2) for x in os.getloadavg()]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))}
    # the JUnit XML and the log outside results/ while the tier runs: a record folder there before its index line
    # fails the tier's own check of results/ (test_records_index)
    with tempfile.TemporaryDirectory(prefix="bench-tests-") as scratch:
        junit = Path(scratch) / "junit.xml"  # the summary keeps what the record is for; the XML names machine paths
        started = time.monotonic()
        with open(a.log or Path(scratch) / "pytest.log", "w") as log:
            cmd = [sys.executable, *COMMAND, f"--durations={a.durations}", f"--junitxml={junit}"]
            rc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
        wall = time.monotonic() - started
        doc = summarize(_tests(junit), wall, rc, machine, [round(x, 2) for x in os.getloadavg()])
    out.mkdir(parents=True, exist_ok=True)
    (out / "cpu-tier.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "cpu-tier.md").write_text(markdown(doc))
    before = [r for r in previous if r["date"] != doc["date"]]
    print(compare(before[-1] if before else None, doc), end="")
    return rc


if __name__ == "__main__":
    sys.exit(main())
