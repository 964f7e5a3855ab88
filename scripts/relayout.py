#!/usr/bin/env python3
"""Move the modules of repro/ into one package per layer of docs/architecture.md, and rewrite every name of them.

    python scripts/relayout.py            # in a checkout: git mv, rewrite, regenerate two tables, ruff
    python scripts/relayout.py --dry-run  # say what it would move and which files it would rewrite; change nothing

The move is LAYOUT below, one row per module: its path before and after (`same` keeps it where it is). A run:
1. checks LAYOUT and the checkout, and stops before it changes anything when a row's module is in neither place,
   in both, or when a module of repro/ has no row (a module added since: give it one);
2. rewrites every name of a moved module in every text file of the checkout (not the records under results/ and
   tests/fixtures/, and not this file or its test): imports (`from repro import report` becomes
   `from repro.report import results as report`), dotted names anywhere (`python -m repro.smcontrol`,
   `"repro.worker:main"`, monkeypatch targets, docs), and paths (`repro/policy.py`, `vllm_integration/gate.py`; in
   docs/architecture.md's drawing also the bare names of repro/'s top-level modules);
3. `git mv`s each module still in its old place, and writes each new package's __init__.py (its docstring);
4. writes docs/architecture.md's layer table and orders its module table by LAYOUT (between their markers);
5. sorts the imports and formats the Python files it changed (ruff check --select I --fix, ruff format).

It is idempotent: a second run changes nothing, and a run after merging code written for the old layout rewrites
only that code. A name is rewritten when it names an old module: an old module that is now a package of the same
name (repro.case, repro.report, repro.vllm_integration.gate) is read as the package wherever what follows it is one
of the package's modules (`repro.case.spec`, `from repro.case import spec`), as the old module everywhere else.

Kept in place on purpose: repro/pytest_options.py (pytest's `pytest11` entry point names it, in every installed
checkout) and repro/vllm_integration/plugin.py's module name (vLLM's `vllm.general_plugins` entry point names
`repro.vllm_integration.plugin:register`): it becomes the package plugin/'s __init__.py, so both entry points work
in an environment installed before the move.
"""

from __future__ import annotations

import argparse
import ast
import io
import re
import shutil
import subprocess
import sys
import tokenize
from dataclasses import dataclass
from pathlib import Path


def same(path: str) -> tuple[str, str]:
    return path, path


def move(old: str, new: str) -> tuple[str, str]:
    return old, new


# (layer, package folder, the docstring of its __init__.py when this script writes one (None: a row moves or keeps
# it), its modules as (old path, new path)). The order is the architecture page's: its tables follow it.
LAYOUT: list[tuple[str, str, str | None, list[tuple[str, str]]]] = [
    (
        "how people call it",
        "repro",
        None,
        [
            same("repro/__init__.py"),
            same("repro/__main__.py"),
            same("repro/pytest_options.py"),  # the pytest11 entry point's name: installed checkouts load it by it
            same("repro/errors.py"),  # every exception, imported by every layer (it imports nothing)
            same("repro/exit_codes.py"),  # every command's exit code, decided from its typed outcome
        ],
    ),
    (
        "how people call it",
        "repro/cli",
        None,
        [
            same("repro/cli/__init__.py"),
            same("repro/cli/common.py"),
            same("repro/cli/matrix.py"),
            same("repro/cli/run.py"),
            same("repro/cli/serve.py"),
            same("repro/cli/vllm.py"),
            same("repro/cli/bisect.py"),
            same("repro/cli/outputs.py"),
            same("repro/cli/reports.py"),
            move("repro/doctor.py", "repro/cli/doctor.py"),
        ],
    ),
    (
        "what a case is",
        "repro/case",
        "What a case is: CaseSpec and CaseResult (spec), the attention shape and capture plan (descriptors), the\n"
        "scenarios and their pass sequences, the poison fills, and the case sets: the matrix's (matrix) and the\n"
        "pytest GPU tier's (sets).",
        [
            move("repro/case.py", "repro/case/spec.py"),
            move("repro/descriptors.py", "repro/case/descriptors.py"),
            move("repro/scenarios.py", "repro/case/scenarios.py"),
            move("repro/poison.py", "repro/case/poison.py"),
            move("repro/case_sets.py", "repro/case/sets.py"),
            move("repro/matrix.py", "repro/case/matrix.py"),
        ],
    ),
    (
        "what runs a case",
        "repro/run",
        "What runs a case: one process per case (runner), how case processes start (executor, server, process), SM\n"
        "restriction and the MPS cases (smcontrol, mps_cases), memcheck (sanitizer), one GPU per pytest worker\n"
        "(pinning, pytest_cases), and the structured channel a case's records come back on (channel, tags).",
        [
            move("repro/runner.py", "repro/run/runner.py"),
            move("repro/executor.py", "repro/run/executor.py"),
            move("repro/server.py", "repro/run/server.py"),
            move("repro/process.py", "repro/run/process.py"),
            move("repro/mps_cases.py", "repro/run/mps_cases.py"),
            move("repro/smcontrol.py", "repro/run/smcontrol.py"),
            move("repro/sanitizer.py", "repro/run/sanitizer.py"),
            move("repro/pinning.py", "repro/run/pinning.py"),
            move("repro/pytest_cases.py", "repro/run/pytest_cases.py"),
            move("repro/channel.py", "repro/run/channel.py"),
            move("repro/tags.py", "repro/run/tags.py"),
        ],
    ),
    (
        "what runs inside a case process",
        "repro/attention",
        "Inside an attention-layer case process: the worker, the persistent-buffer metadata builder with vLLM's\n"
        "semantics, FA3's scheduler-metadata layouts and inputs, the stale-view diff, and the reference attention.",
        [
            move("repro/worker.py", "repro/attention/worker.py"),
            move("repro/builder.py", "repro/attention/builder.py"),
            move("repro/layout.py", "repro/attention/layout.py"),
            move("repro/staleness.py", "repro/attention/staleness.py"),
            move("repro/reference.py", "repro/attention/reference.py"),
            move("repro/scheduler_inputs.py", "repro/attention/scheduler_inputs.py"),
        ],
    ),
    (
        "what runs inside a case process",
        "repro/backends",
        None,
        [
            same("repro/backends/__init__.py"),
            same("repro/backends/base.py"),
            same("repro/backends/upstream.py"),
            same("repro/backends/vllm_fork.py"),
            same("repro/backends/replay.py"),
            same("repro/backends/preload.py"),
        ],
    ),
    (
        "what runs inside a case process",
        "repro/specdecode",
        None,
        [
            same("repro/specdecode/__init__.py"),
            same("repro/specdecode/models.py"),
            same("repro/specdecode/runner.py"),
            same("repro/specdecode/case.py"),
        ],
    ),
    (
        "what judges it",
        "repro/judge",
        "What judges a case: its process's records -> one verdict (classify, over the taxonomy of verdicts), the\n"
        "expectation fixed before it runs (expectations), and the control policy (policy).",
        [
            move("repro/classify.py", "repro/judge/classify.py"),
            move("repro/verdicts.py", "repro/judge/verdicts.py"),
            move("repro/policy.py", "repro/judge/policy.py"),
            move("repro/expectations.py", "repro/judge/expectations.py"),
        ],
    ),
    (
        "what reports it",
        "repro/report",
        "What reports it: the matrix's reports (results), the environment every report shows, redaction of machine\n"
        "paths, the pytest gate's report, benchmarks, and the xdist report.",
        [
            move("repro/report.py", "repro/report/results.py"),
            move("repro/environment.py", "repro/report/environment.py"),
            move("repro/redact.py", "repro/report/redact.py"),
            move("repro/pytest_gate.py", "repro/report/pytest_gate.py"),
            move("repro/benchmark.py", "repro/report/benchmark.py"),
            move("repro/xdist_report.py", "repro/report/xdist.py"),
        ],
    ),
    (
        "what integrates with vLLM",
        "repro/vllm_integration",
        None,
        [same("repro/vllm_integration/__init__.py")],
    ),
    (
        "what integrates with vLLM",
        "repro/vllm_integration/plugin",
        None,
        [
            # the module keeps its name, repro.vllm_integration.plugin: vLLM's entry point names it
            move("repro/vllm_integration/plugin.py", "repro/vllm_integration/plugin/__init__.py"),
            move("repro/vllm_integration/audit.py", "repro/vllm_integration/plugin/audit.py"),
            move("repro/vllm_integration/backend_fields.py", "repro/vllm_integration/plugin/backend_fields.py"),
            move("repro/vllm_integration/backend_hooks.py", "repro/vllm_integration/plugin/backend_hooks.py"),
            move("repro/vllm_integration/capture.py", "repro/vllm_integration/plugin/capture.py"),
            move("repro/vllm_integration/fa3_hooks.py", "repro/vllm_integration/plugin/fa3_hooks.py"),
            move("repro/vllm_integration/counters.py", "repro/vllm_integration/plugin/counters.py"),
            move("repro/vllm_integration/metadata_views.py", "repro/vllm_integration/plugin/metadata_views.py"),
            move("repro/vllm_integration/inject.py", "repro/vllm_integration/plugin/inject.py"),
            move("repro/vllm_integration/weights.py", "repro/vllm_integration/plugin/weights.py"),
        ],
    ),
    (
        "what integrates with vLLM",
        "repro/vllm_integration/gate",
        "The vLLM gate: what a gate case is (case), its process (worker: vLLM's V2 runner on a tiny model), how it\n"
        "is judged (judge, coverage), run (run, process, placement, cache, bench; launch, fork: how its processes start;\n"
        "paths: --compare-paths) and reported (report).",
        [
            move("repro/vllm_integration/gate.py", "repro/vllm_integration/gate/worker.py"),
            move("repro/vllm_integration/gate_case.py", "repro/vllm_integration/gate/case.py"),
            move("repro/vllm_integration/gate_judge.py", "repro/vllm_integration/gate/judge.py"),
            move("repro/vllm_integration/coverage.py", "repro/vllm_integration/gate/coverage.py"),
            move("repro/vllm_integration/gate_run.py", "repro/vllm_integration/gate/run.py"),
            move("repro/vllm_integration/gate/process.py", "repro/vllm_integration/gate/process.py"),
            move("repro/vllm_integration/placement.py", "repro/vllm_integration/gate/placement.py"),
            move("repro/vllm_integration/gate_cache.py", "repro/vllm_integration/gate/cache.py"),
            move("repro/vllm_integration/gate_bench.py", "repro/vllm_integration/gate/bench.py"),
            move("repro/vllm_integration/gate_launch.py", "repro/vllm_integration/gate/launch.py"),
            move("repro/vllm_integration/gate_fork.py", "repro/vllm_integration/gate/fork.py"),
            move("repro/vllm_integration/gate_paths.py", "repro/vllm_integration/gate/paths.py"),
            move("repro/vllm_integration/gate_report.py", "repro/vllm_integration/gate/report.py"),
        ],
    ),
    (
        "what integrates with vLLM",
        "repro/vllm_integration/releases",
        "vLLM builds and releases, read without a GPU: which builds a gate run tests (builds), the source check,\n"
        "a tree's or wheel's plugin facts (compat), the version table (versions), git bisect, the affected range.",
        [
            move("repro/vllm_integration/builds.py", "repro/vllm_integration/releases/builds.py"),
            move("repro/vllm_integration/source_check.py", "repro/vllm_integration/releases/source_check.py"),
            move("repro/vllm_integration/compat.py", "repro/vllm_integration/releases/compat.py"),
            move("repro/vllm_integration/versions.py", "repro/vllm_integration/releases/versions.py"),
            move("repro/vllm_integration/bisect.py", "repro/vllm_integration/releases/bisect.py"),
            move("repro/vllm_integration/release_range.py", "repro/vllm_integration/releases/release_range.py"),
        ],
    ),
    (
        "what predicts it on a CPU",
        "repro/fa3_model",
        None,
        [
            same("repro/fa3_model/__init__.py"),
            same("repro/fa3_model/scope.py"),
            same("repro/fa3_model/scheduler.py"),
            same("repro/fa3_model/reads.py"),
            same("repro/fa3_model/predict.py"),
            same("repro/fa3_model/agreement.py"),
            move("repro/record.py", "repro/fa3_model/record.py"),
        ],
    ),
]

# Text files never rewritten: records of what ran (their commands and paths are history), this file and its test.
KEEP = ("results/", "tests/fixtures/", "scripts/relayout.py", "tests/test_relayout.py")
KEEP_EXCEPT = ("results/README.md",)  # the records' index is a page people read: it names today's code
DOC = "docs/architecture.md"
LAYERS_MARK, MODULES_MARK = "<!-- layers:", "<!-- modules:"


class Refused(Exception):
    """The table or the checkout is not what a run can move: nothing was changed."""


def dotted(path: str) -> str:
    """repro/a/b.py -> repro.a.b; repro/a/__init__.py -> repro.a."""
    parts = path.removesuffix(".py").split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@dataclass
class Plan:
    rows: list[tuple[str, str, str]]  # (old path, new path, package folder)
    packages: dict[str, tuple[str, str | None]]  # folder -> (layer, docstring to write or None)
    moved: dict[str, str]  # old dotted name -> new, for the modules whose name changes
    paths: dict[str, str]  # old path -> new, for the modules whose path changes
    new_names: set[str]  # every module and package name of the new layout
    present: set[str]  # old dotted names whose old file is still there: every mention of them is old
    colliding: set[str]  # old module names that are also a package's name in the new layout


def check_table(layout=LAYOUT) -> Plan:
    rows, packages, problems = [], {}, []
    for layer, folder, doc, modules in layout:
        if folder in packages:
            problems.append(f"package {folder} is in LAYOUT twice")
        packages[folder] = (layer, doc)
        for old, new in modules:
            if new.rpartition("/")[0] != folder:
                problems.append(f"{new} is not a module of its package {folder}")
            rows.append((old, new, folder))
    for kind, i in (("old", 0), ("new", 1)):
        seen = [r[i] for r in rows]
        problems += [f"{p} is an {kind} path of two rows" for p in sorted({p for p in seen if seen.count(p) > 1})]
    moved = {dotted(o): dotted(n) for o, n, _ in rows if dotted(o) != dotted(n)}
    paths = {o: n for o, n, _ in rows if o != n}
    new_names = {dotted(n) for _, n, _ in rows} | {f.replace("/", ".") for f in packages}
    for old, new in moved.items():
        if old in {dotted(n) for _, n, _ in rows}:
            problems.append(f"{old} moves to {new}, but a module of the new layout has its name: not re-runnable")
    problems += [f"{o}: a moved module's old path is another's new path" for o in paths if o in paths.values()]
    for folder, (_, doc) in packages.items():
        has_init = any(n == f"{folder}/__init__.py" for _, n, _ in rows)
        if has_init == (doc is not None):
            problems.append(f"{folder}: give it a docstring exactly when no row moves or keeps its __init__.py")
    if problems:
        raise Refused("LAYOUT: " + "; ".join(problems))
    colliding = {o for o in moved if o in new_names or any(n.startswith(o + ".") for n in new_names)}
    return Plan(rows, packages, moved, paths, new_names, set(), colliding)


def check_checkout(plan: Plan, root: Path) -> list[tuple[str, str]]:
    """The moves still to make; Refused, before anything changes, when the checkout is not one LAYOUT describes."""
    problems, todo = [], []
    for old, new, _ in plan.rows:
        at_old, at_new = (root / old).is_file(), (root / new).is_file()
        if old == new and not at_old:
            problems.append(f"{old} is in LAYOUT but not in the checkout")
        elif old != new and at_old and at_new:
            problems.append(f"{old} and {new} both exist: which is the module?")
        elif old != new and not (at_old or at_new):
            problems.append(f"{old} is in LAYOUT but in neither {old} nor {new}")
        elif old != new and at_old:
            todo.append((old, new))
            plan.present.add(dotted(old))
    known = {p for o, n, _ in plan.rows for p in (o, n)} | {
        f"{f}/__init__.py" for f, (_, d) in plan.packages.items() if d
    }
    files = sorted(
        p.relative_to(root).as_posix() for p in (root / "repro").rglob("*.py") if "__pycache__" not in p.parts
    )
    problems += [
        f"{f} is a module of repro/ with no row in LAYOUT: add one (where it belongs)" for f in files if f not in known
    ]
    for old, _ in todo:
        text = (root / old).read_text()
        if "__file__" in text or re.search(r"^\s*from \.", text, re.M):
            problems.append(f"{old} uses __file__ or a relative import: its meaning would change with its folder")
    if problems:
        raise Refused("the checkout: " + "; ".join(problems))
    return todo


CHAIN = re.compile(r"(?<![\w.])repro(?:\.[A-Za-z_]\w*)+")
FROM_IMPORT = re.compile(r"\s+import\s+(\([^)]*\)|[^\n;]*)")
FULL_PATH = re.compile(r"(?<![\w.-])repro/(?:\w+/)*\w+\.py\b")
SUB_PATH = re.compile(r"(?<![\w./-])(?:\w+/)+\w+\.py\b")
BARE_PATH = re.compile(r"(?<![\w./-])\w+\.py\b")


def _imported_names(clause: str) -> list[str]:
    clause = re.sub(r"#[^\n]*", "", clause).strip().strip("()")
    return [item.split()[0] for item in clause.split(",") if item.strip()]


class Rewriter:
    def __init__(self, plan: Plan, root: Path) -> None:
        self.plan, self.root = plan, root
        self._names: dict[str, set[str]] = {}

    def _module_names(self, old: str) -> set[str]:
        """The names an old module (now a package's namesake) binds at its top: `from P import x` for one of them,
        where x is also one of the package's modules, cannot be told apart."""
        if old not in self._names:
            path = next(n if not (self.root / o).exists() else o for o, n, _ in self.plan.rows if dotted(o) == old)
            tree = ast.parse((self.root / path).read_text())
            names = set()
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names.add(node.name)
                elif isinstance(node, (ast.Import, ast.ImportFrom)):
                    names |= {(a.asname or a.name).split(".")[0] for a in node.names}
                elif isinstance(node, (ast.Assign, ast.AnnAssign)):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
            self._names[old] = names
        return self._names[old]

    def _is_new(self, prefix: str, following: str) -> bool:
        """Does `prefix.following` (or `from prefix import following`) name the new package's module?"""
        return f"{prefix}.{following}" in self.plan.new_names

    def chains(self, text: str, where: str) -> str:
        """Every dotted name that starts with an old module's name, rewritten to the module's new name."""
        plan = self.plan

        def one(m: re.Match) -> str:
            parts = m.group(0).split(".")
            for k in range(len(parts), 1, -1):
                prefix = ".".join(parts[:k])
                if prefix in plan.moved:
                    break
            else:
                return m.group(0)
            rest = parts[k:]
            if prefix in plan.colliding and prefix not in plan.present:  # after the move: the package, or the old?
                if rest:
                    if self._is_new(prefix, rest[0]):
                        return m.group(0)
                else:
                    follows = FROM_IMPORT.match(text, m.end())
                    if follows and re.search(r"\bfrom\s+$", text[max(0, m.start() - 12) : m.start()]):
                        names = _imported_names(follows.group(1))
                        new = [n for n in names if self._is_new(prefix, n)]
                        if new and (len(new) < len(names) or set(new) & self._module_names(prefix)):
                            raise Refused(
                                f"{where}: `from {prefix} import {', '.join(names)}`: old module or new package?"
                            )
                        if new:
                            return m.group(0)
            return ".".join([plan.moved[prefix], *rest])

        return CHAIN.sub(one, text)

    def paths(self, text: str, bare: bool) -> str:
        """repro/x.py paths, and x.py paths under repro/ that name a folder (vllm_integration/gate.py); with bare (the
        drawing), also the bare names of repro/'s top-level modules (matrix.py), and a package's __init__.py by its
        folder."""
        paths = self.plan.paths
        text = FULL_PATH.sub(lambda m: paths.get(m.group(0), m.group(0)), text)

        def relative(m: re.Match) -> str:
            new = paths.get("repro/" + m.group(0))
            if new and bare:  # the drawing names a package's __init__.py by its folder
                new = new.removesuffix("__init__.py")
            return new.removeprefix("repro/") if new else m.group(0)

        text = SUB_PATH.sub(relative, text)
        return BARE_PATH.sub(relative, text) if bare else text

    def imports(self, source: str, where: str) -> str:
        """`from PACKAGE import module, ...` statements whose modules moved: one statement per new package (the
        module under its old name where its name changed); the statement's comments on each."""
        try:
            tree = ast.parse(source)
        except SyntaxError:
            return source
        lines = source.splitlines(keepends=True)
        tokens = tokenize.generate_tokens(io.StringIO(source).readline)
        comments = {tok.start[0]: tok.string for tok in tokens if tok.type == tokenize.COMMENT}
        edits = []
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom) or node.level or not node.module:
                continue
            moving = [a for a in node.names if f"{node.module}.{a.name}" in self.plan.moved]
            if not moving:
                continue
            first, last = lines[node.lineno - 1], lines[node.end_lineno - 1]
            if first[: node.col_offset].strip() or last[node.end_col_offset :].split("#")[0].strip():
                raise Refused(f"{where}:{node.lineno}: an import that shares its line: write it on lines of its own")
            indent = first[: node.col_offset]
            # one statement per new package, and one per module imported under another name (ruff's isort writes
            # those one a line, and a comment must stay on each)
            groups: list[tuple[str, list[str]]] = []
            kept = [a.name if not a.asname else f"{a.name} as {a.asname}" for a in node.names if a not in moving]
            if kept:
                groups.append((node.module, kept))
            for a in moving:
                parent, _, base = self.plan.moved[f"{node.module}.{a.name}"].rpartition(".")
                alias = a.asname or a.name
                plain = next((g for g in groups if g[0] == parent and " as " not in g[1][0]), None)
                if base != alias:
                    groups.append((parent, [f"{base} as {alias}"]))
                elif plain is not None:
                    plain[1].append(base)
                else:
                    groups.append((parent, [base]))
            note = "  ".join(comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments)
            new = "".join(
                f"{indent}from {m} import {', '.join(names)}{'  ' + note if note else ''}\n" for m, names in groups
            )
            edits.append((node.lineno, node.end_lineno, new))
        for start, end, new in sorted(edits, reverse=True):
            lines[start - 1 : end] = [new]
        return "".join(lines)

    def text(self, rel: str, source: str) -> str:
        out = self.chains(source, rel)  # first: the statements `imports` writes hold new names only
        out = self.imports(out, rel) if rel.endswith(".py") else out
        if rel != DOC:
            return self.paths(out, bare=False)
        parts = re.split(r"(^```[^\n]*\n.*?^```$)", out, flags=re.M | re.S)  # the drawing: fenced blocks
        return "".join(self.paths(p, bare=p.startswith("```")) for p in parts)


def text_files(root: Path) -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=root,
        capture_output=True,
        check=True,
    ).stdout.decode()
    out = []
    for rel in sorted(set(filter(None, listed.split("\0")))):
        if rel.startswith(KEEP) and rel not in KEEP_EXCEPT or not (root / rel).is_file():
            continue
        data = (root / rel).read_bytes()
        if b"\0" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        out.append(rel)
    return out


def layer_table(plan: Plan) -> str:
    rows = ["| layer | package | its modules |", "|---|---|---|"]
    for folder, (layer, _) in plan.packages.items():
        mods = [n.rpartition("/")[2] for _, n, f in plan.rows if f == folder]
        rows.append(f"| {layer} | `{folder}/` | {', '.join(f'`{m}`' for m in mods)} |")
    return "\n".join(rows)


def write_doc_tables(plan: Plan, text: str) -> str:
    """The layer table, written from LAYOUT; the module table's rows ordered by LAYOUT (each row's job kept)."""
    lines = text.split("\n")

    def span(mark: str) -> tuple[int, int] | None:
        start = next((i for i, ln in enumerate(lines) if ln.startswith(mark)), None)
        if start is None:
            return None
        end = next(i for i in range(start, len(lines)) if lines[i].startswith("<!-- /"))
        return start, end

    if where := span(LAYERS_MARK):
        lines[where[0] + 1 : where[1]] = layer_table(plan).split("\n")
    if where := span(MODULES_MARK):
        body = lines[where[0] + 1 : where[1]]
        head, rows = body[:2], body[2:]
        order = {n: i for i, (_, n, _) in enumerate(plan.rows)}

        def key(row: str) -> int:
            m = re.match(r"\| `([^`]+)` \|", row)
            return order.get(m.group(1), len(order)) if m else len(order)

        lines[where[0] + 1 : where[1]] = head + sorted(rows, key=key)
    return "\n".join(lines)


def ruff(files: list[str], root: Path) -> None:
    if not files:
        return
    exe = [shutil.which("ruff")] if shutil.which("ruff") else [sys.executable, "-m", "ruff"]
    for args in (["check", "--select", "I", "--fix", "--quiet"], ["format", "--quiet"]):
        r = subprocess.run([*exe, *args, *files], cwd=root, capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(
                f"relayout: moved and rewritten, but `ruff {' '.join(args[:1])}` failed:\n{r.stdout}{r.stderr}"
            )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/relayout.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="say what would move and change; change nothing")
    a = p.parse_args(argv)
    top = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    if top.returncode != 0:
        sys.stderr.write("relayout: run it inside a git checkout of the project\n")
        return 2
    root = Path(top.stdout.strip())
    try:
        plan = check_table()
        todo = check_checkout(plan, root)
        rewriter = Rewriter(plan, root)
        changed = {}
        for rel in text_files(root):
            before = (root / rel).read_text()
            after = rewriter.text(rel, before)
            if after != before:
                changed[rel] = after
    except Refused as e:
        sys.stderr.write(f"relayout: nothing changed: {e}\n")
        return 1
    if a.dry_run:
        for old, new in todo:
            print(f"git mv {old} {new}")
        for rel in sorted(changed):
            print(f"rewrite {rel}")
        return 0
    for rel, text in changed.items():
        (root / rel).write_text(text)
    for old, new in todo:
        (root / new).parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", old, new], cwd=root, check=True)
    made = []
    for folder, (_, doc) in plan.packages.items():
        init = root / folder / "__init__.py"
        if doc is not None and not init.exists():
            init.parent.mkdir(parents=True, exist_ok=True)
            init.write_text(f'"""{doc}"""\n')
            made.append(init.relative_to(root).as_posix())
    if made:
        subprocess.run(["git", "add", *made], cwd=root, check=True)
    doc = root / DOC
    if doc.exists() and (tables := write_doc_tables(plan, doc.read_text())) != doc.read_text():
        doc.write_text(tables)
        changed.setdefault(DOC, tables)
    moved_to = dict(todo)
    py = sorted({moved_to.get(rel, rel) for rel in changed if rel.endswith(".py")} | set(made))
    ruff(py, root)
    print(f"relayout: {len(todo)} modules moved, {len(made)} packages made, {len(changed)} files rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
