"""Checks, from a pytest JUnit XML, that every xdist worker ran its cases on one GPU (or MIG slice) of its own.

The GPU each case ran on is read INSIDE the case process (torch device UUID) and recorded as a JUnit property,
next to the worker id and the device conftest pinned it to."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from repro.errors import ConfigError
from repro.files import read_bounded


def _norm(uuid: str | None) -> str | None:
    if not uuid:
        return None
    u = uuid.strip()
    return u[4:] if u.startswith("GPU-") else u


@dataclass
class PinningReport:
    suite_seconds: float
    workers: dict[str, set[str]] = field(default_factory=dict)  # worker -> GPU uuids its cases ran on
    pinned: dict[str, set[str]] = field(default_factory=dict)  # worker -> devices conftest pinned
    cases: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and bool(self.workers)


def check_junit(path: str | Path, expect_workers: int | None = None) -> PinningReport:

    try:
        root = ET.fromstring(read_bounded(path))  # a regular file of bounded size (ConfigError, one line)
    except ET.ParseError as e:
        raise ConfigError(f"{path}: not a JUnit XML file ({e})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read it ({e.strerror or e})") from None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    if not suites:  # XML, but no test suite in it: bad input (2), not "a worker shared GPUs" (1)
        raise ConfigError(f"{path}: not a JUnit XML file (no <testsuite> element, the root is <{root.tag}>)")
    rep = PinningReport(sum(float(s.get("time", 0)) for s in suites))
    workers: dict[str, set[str]] = defaultdict(set)
    pinned: dict[str, set[str]] = defaultdict(set)
    cases: dict[str, int] = defaultdict(int)
    for tc in root.iter("testcase"):
        props = {p.get("name"): p.get("value") for p in tc.iter("property")}
        w, uuid = props.get("xdist_worker"), _norm(props.get("gpu_uuid"))
        if not w or not uuid or uuid == "None":
            continue
        workers[w].add(uuid)
        cases[w] += 1
        if props.get("pinned_device") not in (None, "None"):
            pinned[w].add(_norm(props["pinned_device"]) or "")
    rep.workers, rep.pinned, rep.cases = dict(workers), dict(pinned), dict(cases)
    if not workers:
        rep.problems.append("no case recorded the GPU it ran on (no GPU cases ran?)")
    for w, uuids in workers.items():
        if len(uuids) != 1:
            rep.problems.append(f"{w} ran on {len(uuids)} GPUs: {sorted(uuids)}")
        if w in pinned and pinned[w] != uuids and not any(p.startswith("MIG-") for p in pinned[w]):
            rep.problems.append(f"{w} was pinned to {sorted(pinned[w])} but ran on {sorted(uuids)}")
    seen: dict[str, str] = {}
    for w, uuids in sorted(workers.items()):
        for u in uuids:
            if u in seen:
                rep.problems.append(f"{w} and {seen[u]} share GPU {u}")
            seen[u] = w
    if expect_workers is not None and len(workers) != expect_workers:
        rep.problems.append(f"expected {expect_workers} workers with GPU cases, found {len(workers)}")
    return rep


def markdown(rep: PinningReport, path: str) -> str:
    lines = [
        f"# xdist pinning: `{path}`",
        "",
        f"Suite time {rep.suite_seconds:.1f} s.",
        "",
        "| worker | cases | GPU (read inside the case process) | pinned by conftest |",
        "|---|---|---|---|",
    ]
    for w in sorted(rep.workers):
        lines.append(
            f"| {w} | {rep.cases.get(w, 0)} | {', '.join(sorted(rep.workers[w]))} | "
            f"{', '.join(sorted(rep.pinned.get(w, set()))) or '-'} |"
        )
    lines += [
        "",
        "OK: every worker on a GPU of its own."
        if rep.ok
        else "PROBLEMS:\n" + "\n".join(f"- {p}" for p in rep.problems),
        "",
    ]
    return "\n".join(lines)
