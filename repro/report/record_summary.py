"""What a record shows, in its line of results/index.json: the files of a record the line is derived from
(`indexed`: its summaries, command and JUnit XML, never its logs) and the line's fields read from them (`describe`:
the commands, when it was recorded, which builds, what it shows, the harness code its run ran). A record's files
come in as bytes (repro.report.records reads them from its folder, its archive or git history)."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

_SUMMARIES = ("results.json", "paths.json", "gate.json")  # the harness's machine-readable outcomes
_COMMAND_PREFIX = re.compile(r"^\S*python3?(\.\d+)? ")


def indexed(rel: str) -> bool:
    """The files a record's index line is derived from (never its logs)."""
    name = Path(rel).name
    return "logs/" not in rel and (name in _SUMMARIES or name == "command.txt" or name.endswith(".xml"))


def _junit(data: bytes) -> str:
    """One line of a JUnit XML (pytest --junitxml): its tests, failures, errors, skips and time."""
    from xml.etree import ElementTree  # JUnit records only

    try:
        root = ElementTree.fromstring(data)
    except ElementTree.ParseError as e:
        return f"JUnit XML that does not parse ({e})"
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    n = {k: sum(int(float(s.get(k, 0))) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    seconds = sum(float(s.get("time", 0)) for s in suites)
    return f"pytest: {n['tests']} tests, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped, {seconds:.1f} s"


def _command(text: str) -> str:
    """A recorded command line without its interpreter's path or a trailing note (`# exit 0, ...`)."""
    line = text.strip().splitlines()[0].split("    #")[0].strip()
    line = re.sub(r"-m repro \S*pytest/__main__\.py", "-m pytest", line)  # how pytest's sys.argv was recorded
    return _COMMAND_PREFIX.sub("python ", line)


def _counts(verdicts: list[str]) -> str:
    return ", ".join(f"{n} {v}" for v, n in Counter(verdicts).most_common())


def _shows(doc: dict) -> str:
    """One line of what a summary file says: its outcome and verdicts, as the harness wrote them."""
    if "paths" in doc:  # gate --compare-paths
        return "; ".join(f"{p}: {d.get('outcome')} in {d.get('wall_s')} s" for p, d in doc["paths"].items())
    if "controls" in doc:  # pytest --gate's gate.json
        return f"{doc.get('outcome')} in {doc.get('wall_s')} s; {len(doc['controls'])} controls"
    verdicts = [c.get("verdict", "?") for c in doc.get("cases", [])]
    if doc.get("kind") or "outcome" in doc:  # repro gate
        affected = f", affected: {' '.join(doc['affected'])}" if doc.get("affected") else ""
        return f"{doc.get('outcome')}{affected}; {len(verdicts)} cases: {_counts(verdicts)}"
    source = " (CPU model)" if doc.get("source") == "model" else ""
    return f"{len(verdicts)} cases{source}: {_counts(verdicts)}; wall {doc.get('wall_s')} s"


def _builds(doc: dict) -> list[str]:
    if doc.get("builds"):
        return [f"vLLM {b['build']} ({b.get('role', '?')})" for b in doc["builds"]]
    return [f"FA3 {n} {b.get('version', '?')}" for n, b in (doc.get("backends") or {}).items() if isinstance(b, dict)]


def describe(files: dict[str, bytes]) -> dict:
    """A record's index fields from its own files: commands, when it was recorded, builds, what it shows."""
    commands, when, builds, shows, codes = [], [], [], [], set()
    docs = {rel: json.loads(data) for rel, data in files.items() if Path(rel).name in _SUMMARIES}
    for rel, data in files.items():
        if Path(rel).name == "command.txt":
            commands.append(_command(data.decode(errors="replace")))
        elif rel.endswith(".xml"):
            shows.append(f"{rel}: {_junit(data)}")
    for rel, doc in docs.items():
        env = doc.get("environment") or {}
        if env.get("command") and not any(Path(r).name == "command.txt" for r in files):
            commands.append(_command(env["command"]))
        when += [env["when"]] if env.get("when") else []
        codes |= {env["harness_code"]} if env.get("harness_code") else set()  # environment.harness_code
        builds += [b for b in _builds(doc) if b not in builds]
        where = str(Path(rel).parent)
        if not (where != "." and Path(rel).name == "results.json" and f"{where}/paths.json" in files):
            shows.append(("" if where == "." else f"{where}: ") + _shows(doc))
    return {
        "commands": list(dict.fromkeys(commands)),
        "recorded": min(when) if when else None,
        "builds": builds,
        "shows": " | ".join(shows) if shows else None,
        "harness_code": codes.pop() if len(codes) == 1 else None,
    }
