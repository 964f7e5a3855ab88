"""docs/architecture.md's claims about the code, each checked against the source (ast and text, and the gate's
declared steps imported; no GPU, no import of torch or vLLM): where a decision is made, which module may write what,
which variables cross a process boundary, which entry points installed environments load. Each test is named for the
claim it keeps true; a change that makes a claim false fails its test, and the doc or the code must change with it."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


def _doc() -> str:
    return DOC.read_text()


def _section(title: str) -> str:
    text = _doc()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end != -1 else None]


def _sources(*folders: str) -> dict[str, ast.Module]:
    """Relative path -> parsed module, for every .py file under the folders (or the file itself)."""
    out = {}
    for f in folders:
        p = ROOT / f
        for path in [p] if p.is_file() else sorted(p.rglob("*.py")):
            out[path.relative_to(ROOT).as_posix()] = _parse(path)
    return out


@functools.cache
def _parse(path: Path) -> ast.Module:
    """Each file parsed once per test session (the trees are only read)."""
    return ast.parse(path.read_text(), str(path))


def _repro() -> dict[str, ast.Module]:
    return _sources("repro")


def _where(path: str, node: ast.AST) -> str:
    return f"{path}:{getattr(node, 'lineno', '?')}: {ast.unparse(node)[:100]}"


# --- what crosses a process boundary --------------------------------------------------------------------------------

# strings of the REPRO_ form that name no variable: the record tags (repro.contract.tags) are printed and parsed, the
# warm process's ready line is printed; REPRO_AUDIT is both a tag and the plugin's own variable
TAGS_MODULE = "repro/contract/tags.py"
NOT_VARIABLES = {"REPRO_WARM_READY"}
VARIABLE_AND_TAG = {"REPRO_AUDIT"}


def _repro_strings(trees: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Every string constant of the form REPRO_NAME -> the files that hold it."""
    found: dict[str, set[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if re.fullmatch(r"REPRO_[A-Z_]*[A-Z]", node.value):
                    found.setdefault(node.value, set()).add(path)
    return found


def _tags() -> set[str]:
    tree = _sources(TAGS_MODULE)[TAGS_MODULE]
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)} & set(
        _repro_strings({TAGS_MODULE: tree})
    )


def test_every_repro_variable_the_code_reads_is_named_where_the_doc_says_what_crosses_a_process_boundary():
    """The doc's section on process boundaries names every REPRO_* variable (the table, a person's knobs, the plugin's
    own); the code of the harness, its pytest tier (conftest.py, cases/) and its tests name no other, and every one
    the doc names is still named by some code (a variable gone must leave the doc)."""
    named = set(re.findall(r"REPRO_[A-Z_]*[A-Z]", _section("What crosses a process boundary, and how")))
    harness = _repro_strings(_sources("repro", "conftest.py", "cases"))
    variables = {v for v in harness if v not in NOT_VARIABLES and (v not in _tags() or v in VARIABLE_AND_TAG)}
    assert len(variables) >= 30, sorted(variables)
    missing = variables - named
    assert not missing, f"REPRO_* variables the code reads that docs/architecture.md does not name: {sorted(missing)}"
    tests = {v for p in (ROOT / "tests").glob("*.py") for v in re.findall(r"REPRO_[A-Z_]*[A-Z]", p.read_text())}
    everywhere = set(harness) | tests
    gone = named - everywhere
    assert not gone, f"docs/architecture.md names REPRO_* variables no code names: {sorted(gone)}"


def _environ_reads(tree: ast.Module) -> list[ast.AST]:
    """os.environ.get(X), os.environ[X], os.getenv(X), environ.get(X) with X a REPRO_ constant or a module constant
    bound to one."""
    consts = {
        t.id: n.value.value
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name)
    }

    def repro(arg: ast.AST) -> bool:
        value = arg.value if isinstance(arg, ast.Constant) else consts.get(getattr(arg, "id", ""))
        return isinstance(value, str) and value.startswith("REPRO_")

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and repro(node.args[0]):
            f = ast.unparse(node.func)
            if f in ("os.getenv", "os.environ.get", "environ.get", "env.get", "os.environ.pop"):
                out.append(node)
        elif isinstance(node, ast.Subscript) and repro(node.slice) and "environ" in ast.unparse(node.value):
            out.append(node)
    return out


def test_a_gate_case_process_is_told_by_its_request_and_takes_no_flag():
    """The gate's case worker reads no REPRO_* variable of its own (its request comes through
    repro.contract.request.read, the build's site folders through releases.builds.add_site_dirs) and its parser
    defines no flag."""
    path = "repro/vllm_integration/gate/worker.py"
    tree = _sources(path)[path]
    reads = [_where(path, n) for n in _environ_reads(tree)]
    assert not reads, f"the gate's case worker reads variables one by one: {reads}"
    flags = [_where(path, n) for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func).endswith(
        ".add_argument"
    )]  # fmt: skip
    assert not flags, f"the gate's case worker takes flags: {flags}"
    calls = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert {"request.read", "add_site_dirs"} <= calls


def test_the_environ_read_finder_finds_a_variable_read_one_by_one():
    tree = ast.parse('import os\nX = "REPRO_FOO"\nos.environ.get(X)\nos.environ["REPRO_BAR"]\nos.getenv("HOME")\n')
    assert [ast.unparse(n) for n in _environ_reads(tree)] == ["os.environ.get(X)", "os.environ['REPRO_BAR']"]


# --- entry points and layers ----------------------------------------------------------------------------------------


def _pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_modules_installed_environments_load_by_name_are_the_entry_points_the_doc_names():
    """`repro.pytest_options` (pytest's pytest11 entry point) and `repro.vllm_integration.plugin` (vLLM's
    vllm.general_plugins entry point, `register`): the names pyproject.toml installs, each module and function
    existing."""
    eps = _pyproject()["project"]["entry-points"]
    assert set(eps["pytest11"].values()) == {"repro.pytest_options", "repro.vllm_integration.ci.pytest_audit"}
    assert all(name == module for name, module in eps["pytest11"].items())  # `-p MODULE` is the same plugin
    assert set(eps["vllm.general_plugins"].values()) == {"repro.vllm_integration.plugin:register"}
    assert (ROOT / "repro" / "pytest_options.py").is_file()
    plugin = ast.parse((ROOT / "repro/vllm_integration/plugin/__init__.py").read_text())
    assert any(isinstance(n, ast.FunctionDef) and n.name == "register" for n in plugin.body)
    text = _doc()
    assert "`repro.pytest_options` (pytest's `pytest11`" in text
    assert "`repro.vllm_integration.plugin` (vLLM's `vllm.general_plugins` entry point, `register`)" in text


def test_the_import_contract_ignores_no_import_as_the_doc_says():
    """The doc: "the contract's `ignore_imports` is empty"; a debt taken on must be listed there and in the doc."""
    contract = next(c for c in _pyproject()["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    says_empty = "the contract's `ignore_imports` is empty" in _doc()
    assert says_empty == (contract.get("ignore_imports", []) == []), contract.get("ignore_imports")


def test_the_exceptions_module_imports_nothing():
    """repro/errors.py (the bottom of every layer): "it imports nothing" (but `from __future__`)."""
    tree = _sources("repro/errors.py")["repro/errors.py"]
    imports = [
        ast.unparse(n)
        for n in ast.walk(tree)
        if isinstance(n, (ast.Import, ast.ImportFrom))
        and not (isinstance(n, ast.ImportFrom) and n.module == "__future__")
    ]
    assert not imports, imports


def test_every_subcommand_is_registered_by_the_one_cli_module_whose_row_names_it():
    """`repro/cli/__init__.py`: each subcommand in the one module of the module table that names it: every
    subcommand of `python -m repro` is named (in backticks, before its row's colon) by exactly one cli module's row,
    and that module's add_parsers registers it."""
    import argparse  # noqa: PLC0415  only this test builds parsers

    from repro import cli  # noqa: PLC0415  the cli imports much: only this test needs it

    rows = dict(re.findall(r"^\| `repro/cli/(\w+)\.py` \| (.*) \|$", _doc(), re.M))
    named = {m: set(re.findall(r"`([a-z][a-z-]*)`", row.split(":")[0])) for m, row in rows.items()}
    every = set(next(a for a in cli.build_parser()._actions if a.dest == "cmd").choices)
    for command in every:
        owners = [m for m, names in named.items() if command in names]
        assert len(owners) == 1, f"`{command}` is named by the rows of {owners}, not by one"
        sub = argparse.ArgumentParser().add_subparsers()
        getattr(cli, owners[0]).add_parsers(sub)
        assert command in sub.choices, f"repro/cli/{owners[0]}.py's row names `{command}`; it does not register it"
    assert set().union(*named.values()) - every <= {"python"}, "rows name subcommands the parser does not have"


# --- one verdict, one decision --------------------------------------------------------------------------------------

JUDGING = (
    "repro/vllm_integration/gate/judge.py",
    "repro/vllm_integration/gate/steps.py",
    "repro/vllm_integration/gate/coverage.py",
)
ORCHESTRATOR = "repro/vllm_integration/gate/run.py"
OUTCOME = "repro/vllm_integration/gate/outcome.py"  # GateRun: what the orchestrator's run holds and decides
# what a record's judging decides: once classify built it, the gate's judging never edits these in place
JUDGED_FIELDS = {"verdict", "reason", "evidence", "kernel", "expected", "stale_fields", "flags", "history"}
LIST_EDITS = {"append", "extend", "insert", "pop", "remove", "clear", "update"}


def _edits_in_place(tree: ast.Module, fields: set[str]) -> list[ast.AST]:
    """Attribute stores (x.f = ..., x.f += ...) and in-place edits (x.f.append(...)) of the fields."""
    out = []
    for node in ast.walk(tree):
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AugAssign, ast.AnnAssign))
            else []
        )
        for t in targets:
            for a in ast.walk(t):
                if isinstance(a, ast.Attribute) and isinstance(a.ctx, ast.Store) and a.attr in fields:
                    out.append(node)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in LIST_EDITS:
            if isinstance(node.func.value, ast.Attribute) and node.func.value.attr in fields:
                out.append(node)
    return out


def _replaces_verdict(tree: ast.Module) -> list[ast.AST]:
    """dataclasses.replace(x, verdict=..., reason=...): a verdict or reason changed without a history entry."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) in ("replace", "dataclasses.replace")
        and {k.arg for k in n.keywords} & {"verdict", "reason"}
    ]


def test_the_gates_judging_makes_new_records_and_never_edits_one():
    """Annotation, reference validation and comparison, coverage and the run's judging over them: each makes a new
    record (CaseResult.revised, or dataclasses.replace), the earlier left as it was."""
    trees = _sources(*JUDGING, ORCHESTRATOR)
    edits = [_where(p, n) for p, t in trees.items() for n in _edits_in_place(t, JUDGED_FIELDS)]
    assert not edits, "the gate's judging edits a record in place:\n" + "\n".join(edits)
    revised = sum(
        1
        for t in trees.values()
        for n in ast.walk(t)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        if n.func.attr == "revised"
    )
    assert revised >= 5, revised  # the judging's steps do revise


def _doc_steps() -> list[tuple[str, str]]:
    """The steps' list of "From a command to a report": (name, phase) per row, in its order."""
    block = re.search(r"<!-- steps:.*?-->(.*?)<!-- /steps -->", _section("From a command to a report"), re.S)
    assert block, "docs/architecture.md lists no judging steps"
    rows = [line.split("|")[1:3] for line in block[1].splitlines() if line.startswith("| `")]
    return [(name.strip().strip("`"), phase.strip()) for name, phase in rows]


def test_the_gates_judging_is_the_declared_list_of_steps_the_doc_lists_in_its_order():
    """`the gate's judging of a case is one declared, ordered list of named steps (STEPS ...)`: the doc's list is
    STEPS, name and phase, in its order (a step added, removed, renamed or moved in one and not the other fails)."""
    from repro.vllm_integration.gate import steps  # noqa: PLC0415  (its imports hold no torch or vLLM)

    assert _doc_steps() == [(s.name, s.when) for s in steps.STEPS]


def _history_words(path: str, tree: ast.Module, constants: dict[str, str]) -> list[tuple[str | None, str]]:
    """(the step word, where) of every CaseResult.revised call in a module: a string, a module's constant (any gate
    module's), or a name the same function bound to a string; None where it is none of those."""
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.Lambda))]:
        local = {
            t.id: a.value.value
            for a in ast.walk(fn)
            if isinstance(a, ast.Assign) and isinstance(a.value, ast.Constant) and isinstance(a.value.value, str)
            for t in a.targets
            if isinstance(t, ast.Name)
        }
        for call in _calls(fn, "revised"):
            if not call.args or call in {c for c, _ in out}:
                continue
            arg = call.args[0]
            word = arg.value if isinstance(arg, ast.Constant) else None
            if isinstance(arg, ast.Name):
                word = local.get(arg.id, constants.get(arg.id))
            out.append((call, word))
    return [(word, _where(path, call)) for call, word in out]


def test_every_step_a_gate_history_names_is_a_declared_step_or_one_of_the_runs_the_doc_names():
    """Every word a gate module writes into a history (CaseResult.revised's step) is a step of STEPS or one of the
    run's own the doc names beside them, and each of those is still written somewhere: an unknown step, or a declared
    one no code writes any more, fails."""
    from repro.vllm_integration.gate import steps  # noqa: PLC0415  (its imports hold no torch or vLLM)

    trees = _sources("repro/vllm_integration/gate")
    constants = {
        t.id: n.value.value
        for tree in trees.values()
        for n in tree.body
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)
        for t in n.targets
        if isinstance(t, ast.Name)
    }
    found = [w for p, t in trees.items() for w in _history_words(p, t, constants)]
    runs = re.search(r"<!-- run steps -->(.*?)<!-- /run steps -->", _section("From a command to a report"), re.S)
    assert runs, "docs/architecture.md names none of the run's own steps"
    run_words = set(re.findall(r"`([^`/]+?)`", runs[1])) - {p.rsplit("/", 1)[-1] for p in trees}
    declared = {s.name for s in steps.STEPS}
    unknown = [where for word, where in found if word not in declared | run_words]
    assert not unknown, "history words neither declared in STEPS nor named by the doc:\n" + "\n".join(unknown)
    written = {word for word, _ in found}
    assert declared - written == {"annotation"}, declared - written  # the annotation completes a record, no history
    assert run_words <= written, run_words - written


def test_after_classify_a_verdict_or_reason_changes_only_through_revised():
    """Once classify built a case's record, a verdict changes only through CaseResult.revised (its history saying
    why): no other module of the run, judge, report or gate layers stores a verdict, and none replaces a verdict or a
    reason without history (the starter's additions to a reason, in runner and mps_cases, are the doc's exception)."""
    trees = {
        p: t
        for p, t in _sources(
            "repro/run", "repro/judge", "repro/report", "repro/vllm_integration/gate", "repro/cli"
        ).items()
        if p != "repro/judge/classify.py"
    }
    stores = [_where(p, n) for p, t in trees.items() for n in _edits_in_place(t, {"verdict"})]
    replaced = [_where(p, n) for p, t in trees.items() for n in _replaces_verdict(t)]
    assert not stores + replaced, "a verdict or reason changed without CaseResult.revised:\n" + "\n".join(
        stores + replaced
    )
    reasons = {p for p, t in trees.items() if _edits_in_place(t, {"reason"})}
    assert reasons <= {"repro/run/runner.py", "repro/run/mps_cases.py"}, sorted(reasons)


def test_the_in_place_edit_finder_finds_edits():
    tree = ast.parse("r.verdict = 1\nr.reason += 'x'\nr.flags.append(2)\nq = replace(r, verdict=3)\nr.wall_s = 4\n")
    assert len(_edits_in_place(tree, JUDGED_FIELDS)) == 3
    assert len(_replaces_verdict(tree)) == 1


def _reason_word_tests(tree: ast.Module) -> list[ast.AST]:
    """`"..." in x.reason`, `x.reason.startswith(...)` and the like: a decision made by a reason's words."""

    def is_reason(node: ast.AST) -> bool:
        return (isinstance(node, ast.Name) and node.id.endswith("reason")) or (
            isinstance(node, ast.Attribute) and node.attr.endswith("reason")
        )

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(isinstance(o, (ast.In, ast.NotIn)) for o in node.ops):
            if any(is_reason(c) for c in node.comparators):
                out.append(node)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in ("startswith", "endswith", "find", "index", "count") and is_reason(node.func.value):
                out.append(node)
    return out


UPGRADER = "repro/report/records.py"


def test_no_module_but_the_upgrader_decides_by_the_words_of_a_reason():
    """What happened to a process is a typed flag (CaseResult.flags) later steps decide by, never the words of a
    reason; only the one upgrader of recorded results reads a reason's words (a record from before flags)."""
    found = [
        _where(p, n) for p, t in _repro().items() if p != UPGRADER for n in _reason_word_tests(t)
    ]  # fmt: skip
    assert not found, "decisions by a reason's words:\n" + "\n".join(found)
    assert _reason_word_tests(_sources(UPGRADER)[UPGRADER]), "the upgrader no longer reads words: update the doc"


def test_the_reason_word_finder_finds_them():
    tree = ast.parse("a = 'x' in res.reason\nb = reason.startswith('y')\nc = 'z' in res.flags\nd = res.reason + 'w'\n")
    assert len(_reason_word_tests(tree)) == 2


def _calls(tree: ast.Module, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Attribute) and n.func.attr == name)
            or (isinstance(n.func, ast.Name) and n.func.id == name)
        )
    ]


def test_the_gates_outcome_is_decided_in_gate_outcome_and_every_report_reads_the_stored_one():
    """One stored decision: GateRun.judge decides the outcome once and stores it (GateJudgment); reports, the
    comparison of paths and the exit code read it (judged) and never compute it again (outcome, blind)."""
    trees = _sources("repro", "cases")
    again = [_where(p, n) for p, t in trees.items() if p != OUTCOME for f in ("outcome", "blind") for n in _calls(t, f)]
    assert not again, "a gate outcome computed outside GateRun.judge:\n" + "\n".join(again)
    made = {p for p, t in trees.items() if _calls(t, "GateJudgment")}
    assert made == {OUTCOME}, sorted(made)
    readers = {p for p, t in trees.items() if _calls(t, "judged")}
    assert {"repro/vllm_integration/gate/report.py", "repro/cli/gate.py"} <= readers, sorted(readers)


def test_a_plain_mode_crash_is_rerun_in_gate_process_reached_through_run_control_from_gate_run():
    """`vllm_integration/gate/process.py (run_attributed) reruns a plain-mode crash with CUDA_LAUNCH_BLOCKING=1 ...,
    called through run_control from vllm_integration/gate/run.py`."""
    trees = _repro()
    process = "repro/vllm_integration/gate/process.py"
    callers = {p for p, t in trees.items() if _calls(t, "run_attributed")}
    assert callers == {process}, sorted(callers)
    control = next(
        n for n in trees[process].body if isinstance(n, ast.FunctionDef) and n.name == "run_control"
    )  # fmt: skip
    assert _calls(control, "run_attributed")
    blocking = {
        p
        for p, t in trees.items()
        for n in ast.walk(t)
        if isinstance(n, ast.keyword) and n.arg == "launch_blocking" and ast.unparse(n.value) == "True"
    }
    assert blocking == {process}, sorted(blocking)
    assert {p for p, t in trees.items() if _calls(t, "run_control")} == {ORCHESTRATOR}


def test_exit_codes_decides_the_code_of_every_gate_outcome_and_commands_return_members_of_exit():
    """Every command's code for its outcome comes from repro/exit_codes.py: no module but it maps a GateOutcome to
    a code (GATE), and the cli's commands return exit_codes' functions or members of Exit, never a bare name."""
    trees = _repro()
    mapped = {p for p, t in trees.items() for n in ast.walk(t) if isinstance(n, ast.Dict) and any(
        isinstance(k, ast.Attribute) and ast.unparse(k).startswith("GateOutcome.") for k in n.keys
    ) and any(isinstance(v, ast.Attribute) and ast.unparse(v).startswith("Exit.") for v in n.values)}  # fmt: skip
    assert mapped == {"repro/exit_codes.py"}, sorted(mapped)
    bare = []
    for path, tree in trees.items():
        if not path.startswith("repro/cli/"):
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name.startswith("cmd_")):
            for r in (n for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None):
                code = ast.unparse(r.value)
                if not ("Exit." in code or "exit_codes." in code or isinstance(r.value, ast.Call)):
                    bare.append(_where(path, r))
    assert not bare, "commands returning a code not from repro/exit_codes.py:\n" + "\n".join(bare)


def _numeric_exit_writers() -> set[str]:
    """The modules whose `main` returns, or whose sys.exit/SystemExit gives, a non-zero int literal."""
    found = set()
    for path, tree in _repro().items():
        if path == "repro/exit_codes.py":
            continue
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            command = fn.name == "main" or fn.name.startswith("cmd_")
            for node in ast.walk(fn):
                value = None
                if isinstance(node, ast.Return) and command:
                    value = node.value
                elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "SystemExit"):
                    value = node.args[0] if node.args else None
                if isinstance(value, ast.Constant) and isinstance(value.value, int) and value.value not in (0, None):
                    found.add(path)
    return found


def test_the_processes_the_doc_says_still_write_a_code_as_a_number_are_exactly_those_that_do():
    """The doc names the processes that still write an exit code as a number (beside "no other command's module
    writes a code as a number"): the list is today's, a debt paid leaves it, a new one must be named."""
    m = re.search(r"no other command's module writes a code as a\s+number; (.*?)\)\n", _doc(), re.S)
    assert m, "docs/architecture.md no longer says which processes write a code as a number"
    named = {f"repro/{p}" for p in re.findall(r"([\w/]+\.py)", m.group(1))}
    assert named == _numeric_exit_writers(), f"the doc names {sorted(named)}"


# --- records from older runs ----------------------------------------------------------------------------------------

CHANNEL = "repro/contract/channel.py"


def _mentions(tree: ast.Module, name: str) -> bool:
    return any(
        (isinstance(n, ast.Name) and n.id == name)
        or (isinstance(n, ast.Attribute) and n.attr == name)
        or (isinstance(n, ast.alias) and n.name == name)
        for n in ast.walk(tree)
    )


def test_only_the_replays_upgrader_writes_the_marks_of_what_a_record_predates():
    """RECORDED_BEFORE (contract/channel.py), "written by the replays' upgrader only": no module but
    repro/report/records.py names it or its key besides channel.py, which only reads it."""
    trees = _repro()
    users = {
        p
        for p, t in trees.items()
        if _mentions(t, "RECORDED_BEFORE")
        or any(isinstance(n, ast.Constant) and n.value == "recorded_before" for n in ast.walk(t))
    }
    assert users == {CHANNEL, UPGRADER}, sorted(users)
    writes = []
    for node in ast.walk(trees[CHANNEL]):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Name) and k.id == "RECORDED_BEFORE" for k in node.keys):
            writes.append(node)
        if (
            isinstance(node, ast.Subscript)
            and isinstance(node.ctx, ast.Store)
            and "RECORDED_BEFORE" in ast.unparse(node)
        ):
            writes.append(node)
    assert not writes, [ast.unparse(w) for w in writes]
    assert "`RECORDED_BEFORE`, written by the replays' upgrader only" in _doc()


def test_the_upgraders_are_used_where_the_doc_says():
    """upgrade_channel and upgrade_gate_row: by the replays only (no module of repro/ but their own calls them;
    tests/recorded_gate.py does); upgrade_result: for a results.json of an older schema (report/results.py's
    load_json), and the replays."""
    trees = _repro()
    for replays_only in ("upgrade_channel", "upgrade_gate_row"):
        users = {p for p, t in trees.items() if _mentions(t, replays_only)}
        assert not users, f"modules of repro/ that use the replays' upgrader {replays_only}: {users}"
    defined = {n.name for n in trees[UPGRADER].body if isinstance(n, ast.FunctionDef)}
    assert {"upgrade_channel", "upgrade_result", "upgrade_gate_row"} <= defined
    result_users = {p for p, t in trees.items() if _mentions(t, "upgrade_result")}
    assert result_users == {"repro/report/results.py"}, sorted(result_users)
    replays = _sources("tests/recorded_gate.py")["tests/recorded_gate.py"]
    assert all(_mentions(replays, f) for f in ("upgrade_channel", "upgrade_result", "upgrade_gate_row"))


# --- the pytest tier ------------------------------------------------------------------------------------------------


def _imported_names(tree: ast.Module) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.ImportFrom) and n.module:
            out.setdefault(n.module, set()).update(a.name for a in n.names)
        elif isinstance(n, ast.Import):
            for a in n.names:
                out.setdefault(a.name, set())
    return out


def test_the_pytest_tiers_cases_come_from_the_modules_the_doc_names():
    """cases/test_stale_metadata.py and cases/test_spec_decode.py over case/sets.py; cases/test_vllm_gate.py over the
    gate's run_gate, its modes DEFAULT_MODES of gate/modes.py through gate/settings.py (case/sets.py holds the attention layer's lists only),
    one run_gate(..., only=build) per build, method and mode."""
    trees = _sources("cases")
    for name in ("cases/test_stale_metadata.py", "cases/test_spec_decode.py"):
        imports = _imported_names(trees[name])
        assert "repro.case.sets" in imports or "sets" in imports.get("repro.case", set()), name
    gate = trees["cases/test_vllm_gate.py"]
    imports = _imported_names(gate)
    assert "settings" in imports.get("repro.vllm_integration.gate.settings", set())  # the tier's variables, judged
    settings = _sources("repro/vllm_integration/gate/settings.py")["repro/vllm_integration/gate/settings.py"]
    assert "DEFAULT_MODES" in _imported_names(settings).get("repro.vllm_integration.gate.modes", set())
    assert "repro.case.sets" not in imports and "sets" not in imports.get("repro.case", set())
    calls = _calls(gate, "run_gate")
    assert len(calls) == 1 and "only" in {k.arg for k in calls[0].keywords}
    sets = _sources("repro/case/sets.py")["repro/case/sets.py"]
    assert not any(m.startswith("repro.vllm_integration") for m in _imported_names(sets))


def _marks_in_code() -> set[str]:
    """The marks of what a recorded record predates: channel.py's constants after RECORDED_BEFORE, up to the function
    that reads them."""
    body, marks, inside = _sources(CHANNEL)[CHANNEL].body, set(), False
    for node in body:
        if isinstance(node, ast.FunctionDef) and inside:
            break
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
            if inside:
                marks.add(name)
            inside = inside or name == "RECORDED_BEFORE"
    return marks


def test_the_doc_lists_every_mark_of_what_a_record_predates_and_the_upgrader_writes_each():
    """The doc's list of RECORDED_BEFORE's marks is channel.py's (a mark added there must be named), and each is one
    the replays' upgrader (repro/report/records.py) imports to write."""
    m = re.search(r"\(`RECORDED_BEFORE`, and the marks: (.*?)\); a live", _doc(), re.S)
    assert m, "docs/architecture.md no longer lists the marks of what a record predates"
    named = set(re.findall(r"\b[A-Z][A-Z_]{3,}\b", m.group(1)))
    code = _marks_in_code()
    assert len(code) >= 6 and named == code, f"the doc lists {sorted(named)}, contract/channel.py has {sorted(code)}"
    imported = _imported_names(_sources(UPGRADER)[UPGRADER]).get("repro.contract.channel", set())
    assert code <= imported, f"marks the upgrader never writes: {sorted(code - imported)}"


# what runs inside a case process: the attention and spec-decode workers, the FA3 backends, the gate's worker and the
# plugin inside vLLM, over the contract they share
CASE_PROCESS = (
    "repro/attention",
    "repro/specdecode",
    "repro/backends",
    "repro/vllm_integration/plugin",
    "repro/vllm_integration/gate/worker.py",
    "repro/contract",
)
# the variables a case process may read: its request, its channel (the build's site folders: releases.builds, read
# through add_site_dirs), and the plugin's own for a person's vLLM run outside the gate (three, and the run token it sets)
CASE_VARIABLES = {
    "REPRO_REQUEST",
    "REPRO_CHANNEL",
    "REPRO_AUDIT",
    "REPRO_AUDIT_FILE",
    "REPRO_ATTENTION_BACKEND",
    "REPRO_AUDIT_RUN",
    "REPRO_AUDIT_STARTED",
    "REPRO_AUDIT_STRICT",
}
# named there, read elsewhere: the gate reads REPRO_GATE_INSPECT (worker.INSPECT_ENV) into the request
NAMED_FOR_THE_GATE = {("repro/vllm_integration/gate/worker.py", "REPRO_GATE_INSPECT")}


def _docstrings(tree: ast.Module) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def test_no_case_process_module_names_a_persons_knob():
    """The doc: "A person's knobs, read where the command starts (never by a case process; the gate copies the case's
    part into its request)": the modules that run inside a case process name no REPRO_* variable but the request,
    the channel and the plugin's own (and the record tags they print)."""
    tags, found = _tags(), []
    for path, tree in _sources(*CASE_PROCESS).items():
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                name = node.value
                if re.fullmatch(r"REPRO_[A-Z_]*[A-Z]", name) and name not in CASE_VARIABLES | tags:
                    if (path, name) not in NAMED_FOR_THE_GATE:
                        found.append(f"{path}:{node.lineno}: {name}")
    assert not found, "a person's knob named inside a case process:\n" + "\n".join(found)
    gate_case = _sources("repro/vllm_integration/gate/case.py")["repro/vllm_integration/gate/case.py"]
    popped = next(
        n for n in gate_case.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "PLUGIN_OWN_VARS"
    )
    assert (
        ast.unparse(popped.value) == "(AUDIT_ENV, FILE_ENV, BACKEND_ENV, RUN_ENV, *RUN_VARS)"
    )  # a gate case never passes them on


def test_what_happened_to_a_process_is_one_of_eight_flags_set_where_the_doc_says():
    """The doc: "what happened to the process beside its verdict (stalled, refused, rerun alone under MPS, stopped
    while capturing, its GPU failing the platform check, a CUDA error in its output, its reference not trusted ..., a
    self control that re-created no defect) is a typed flag (CaseResult.flags)": the eight flags of case/spec.py,
    each added by the one module that saw it (a refusal and a CUDA error by classify, from the process's output, the
    one reader of it; a stall by the runner; a rerun alone by the MPS scheduler; a timeout after vLLM's capture began
    by classify, from vLLM's output, the words the case names (begun_marker); a failed platform check by the gate's step that judged it, and by the scheduler for
    a case it did not run after another's in its SM configuration failed it; an untrusted reference by its validation,
    carried by the comparison to each case judged against it; a self control that re-created no defect by vouch)."""
    spec = _sources("repro/case/spec.py")["repro/case/spec.py"]
    flags = next(n for n in spec.body if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "FLAGS")
    assert ast.unparse(flags.value) == (
        "(STALLED, REFUSED, RERUN_ALONE, CAPTURING, PLATFORM_FAILED, UNTRUSTED_REFERENCE, CUDA_ERROR, RECREATED_NOTHING)"
    )
    assert (
        "(stalled, refused, rerun alone under MPS, stopped while capturing, its GPU failing the platform check, a CUDA "
        "error in its output, its reference not trusted by the validation: on that reference and on every case "
        "compared with it, a self control that re-created no defect) is a typed flag (`CaseResult.flags`)"
        in " ".join(_doc().split())
    )
    given = {  # a flag given to a new record (CaseResult.revised(..., flags=[...]))
        (p, ast.unparse(k.value))
        for p, t in _repro().items()
        for n in _calls(t, "revised")
        for k in n.keywords
        if k.arg == "flags"
    }
    assert given == {
        ("repro/vllm_integration/gate/steps.py", "[*res.flags, PLATFORM_FAILED]"),
        ("repro/vllm_integration/gate/run.py", "[PLATFORM_FAILED]"),
        ("repro/vllm_integration/gate/judge.py", "flags"),  # validate_reference: [*res.flags, UNTRUSTED_REFERENCE]
        ("repro/vllm_integration/gate/judge.py", "[*res.flags, *carried]"),  # apply_reference: CARRIED_FROM_REFERENCE
    }, sorted(given)  # vouch's `flags` too: [*res.flags, RECREATED_NOTHING] where coverage.recreated_nothing says so
    judge = _sources("repro/vllm_integration/gate/judge.py")["repro/vllm_integration/gate/judge.py"]
    assert "flags = [*res.flags, UNTRUSTED_REFERENCE]" in ast.unparse(judge)
    assert "flags = [*res.flags, RECREATED_NOTHING] if nothing is not None else res.flags" in ast.unparse(judge)
    added = {
        (p, ast.unparse(n.args[0]))
        for p, t in _repro().items()
        for n in _calls(t, "append")
        if isinstance(n.func, ast.Attribute) and ast.unparse(n.func.value).endswith(".flags")
    }
    assert added == {
        ("repro/judge/classify.py", "REFUSED_FLAG"),
        ("repro/run/runner.py", "STALLED"),
        ("repro/run/mps_cases.py", "RERUN_ALONE"),
        ("repro/judge/classify.py", "CAPTURING"),
        ("repro/judge/classify.py", "CUDA_ERROR"),
    }, sorted(added)


def test_the_recorded_metadata_backend_serves_the_cpu_tests_only():
    """`repro/backends/replay.py`: "for the CPU tests only, not the CLI": no module of repro/ or cases/ imports it or
    names it (load_backend knows upstream and vllm alone); the CPU tests do."""
    users = [
        p
        for p, t in _sources("repro", "cases", "conftest.py").items()
        if p != "repro/backends/replay.py"
        and (
            "repro.backends.replay" in _imported_names(t)
            or "replay" in _imported_names(t).get("repro.backends", set())
            or any(isinstance(n, ast.Constant) and n.value == "repro.backends.replay" for n in ast.walk(t))
        )
    ]
    assert not users, users
    tests = [p.name for p in (ROOT / "tests").glob("test_*.py") if "repro.backends.replay" in p.read_text()]
    assert tests, "no CPU test uses the recorded metadata backend: the doc's row is stale"


# --- the gate's run, read as its steps ------------------------------------------------------------------------------

GATE_STEPS = ("plan", "launch", "collect", "judge", "report")
# the modules a `repro gate` run goes through from its command to its report (the spine above, the gate's column)
GATE_PATH = ("repro/cli/gate.py", ORCHESTRATOR, OUTCOME, "repro/vllm_integration/gate/report.py")
GATE_PATH += ("repro/vllm_integration/gate/checked.py",)
MAX_FUNCTION_LINES = 60


def _functions(tree: ast.Module) -> list[ast.FunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_the_gate_run_is_a_scheduler_whose_methods_are_the_steps_the_doc_names_called_in_order():
    """`vllm_integration/gate/run.py (run_gate: a GateScheduler whose steps are plan, launch, collect, judge, report,
    in that order)`: each step a method, called once by the scheduler's __call__ in that order, and run_gate hands
    over to it."""
    text = DOC.read_text()
    assert "GateScheduler whose steps are\n                  plan, launch, collect, judge, report" in text
    tree = _parse(ROOT / ORCHESTRATOR)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GateScheduler")
    methods = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)}
    assert set(GATE_STEPS) <= set(methods), sorted(methods)
    calls = [
        c
        for c in ast.walk(methods["__call__"])
        if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute) and c.func.attr in GATE_STEPS
    ]
    called = [c.func.attr for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]
    assert called == list(GATE_STEPS)
    run_gate = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run_gate")
    assert _calls(run_gate, "GateScheduler"), "run_gate does not hand over to GateScheduler"


def test_no_function_on_the_gates_path_is_over_60_lines():
    """A step reads like its step: no function or method of the gate command, its run or its outcome is longer than
    60 lines (run_gate was 188, cmd_gate 144 and the report's markdown 102)."""
    long = [
        f"{path}:{f.lineno} {f.name}: {f.end_lineno - f.lineno + 1} lines"
        for path in GATE_PATH
        for f in _functions(_parse(ROOT / path))
        if f.end_lineno - f.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, long


def _closures_over_later_names(fn: ast.FunctionDef) -> list[str]:
    """Names a nested function reads that its enclosing function assigns only after the nested one is defined."""
    found = []
    for inner in (n for n in fn.body if isinstance(n, (ast.FunctionDef, ast.Lambda))):
        own = {a.arg for a in ast.walk(inner.args) if isinstance(a, ast.arg)}
        own |= {n.id for n in ast.walk(inner) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        reads = {n.id for n in ast.walk(inner) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - own
        for later in (s for s in fn.body if s.lineno > inner.lineno):
            stores = {n.id for n in ast.walk(later) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
            found += [f"{fn.name}.{inner.name}: {name}" for name in sorted(reads & stores)]
    return found


def test_no_function_on_the_gates_path_closes_over_a_name_assigned_after_it():
    """A nested function reads only what was there when it was defined (run_gate's closures read pool, budget and
    launch, assigned further down)."""
    late = [x for path in GATE_PATH for f in _functions(_parse(ROOT / path)) for x in _closures_over_later_names(f)]
    assert not late, late


def test_the_closure_finder_finds_a_name_assigned_after_the_closure():
    tree = ast.parse(
        "def f():\n    def g(c):\n        x = c\n        return pool, x\n    pool = c = x = 1\n    return g\n"
    )
    assert _closures_over_later_names(tree.body[0]) == ["f.g: pool"]


def test_the_mps_cases_module_serves_the_matrix_and_the_gate_as_its_row_says():
    """`repro/run/mps_cases.py`'s row: the matrix's and the vLLM gate's MPS cases alike (run_mps_cases)."""
    row = re.search(r"^\| `repro/run/mps_cases.py` \| (.*) \|$", DOC.read_text(), re.M).group(1)
    callers = {p for p, t in _repro().items() if _calls(t, "run_mps_cases")}
    assert callers == {"repro/run/matrix.py", ORCHESTRATOR}, sorted(callers)
    assert all(p.removeprefix("repro/") in row for p in callers), row


def test_classify_reads_of_the_free_form_output_only_the_markers_the_doc_names():
    """The spine and classify's row name every group of words classify looks for in a process's free-form output
    (its module's *_MARKERS), and no other."""
    tree = _parse(ROOT / "repro/judge/classify.py")
    markers = {
        t.id
        for n in tree.body
        if isinstance(n, ast.Assign)
        for t in n.targets
        if isinstance(t, ast.Name) and t.id.endswith("_MARKERS")
    }
    text = DOC.read_text()
    row = re.search(r"^\| `repro/judge/classify.py` \| (.*) \|$", text, re.M).group(1)
    spine = text[: text.index("The gate's judging of a case")]
    for where in (row, spine):
        assert set(re.findall(r"\b[A-Z]+_MARKERS\b", where)) == markers, (sorted(markers), where[:200])


def test_the_glossary_defines_the_domain_words_the_code_keeps_once_each():
    """docs/architecture.md's glossary: each coined or domain word the code's names keep (vouch, self control,
    reference, forkserver, ...) has one row, and each word is used in repro/ (a row for a word gone is stale)."""
    text = DOC.read_text()
    table = text[text.index("<!-- glossary:") : text.index("<!-- /glossary -->")]
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    words = [w.strip() for row in rows[1:] for w in re.sub(r"\(.*?\)", "", row).split(",")]
    assert len(words) == len(set(words)), words
    for must in ("vouch", "self control", "reference", "forkserver", "harness blind", "not applicable", "said"):
        assert must in words, must
    code = " ".join(p.read_text().lower() for p in (ROOT / "repro").rglob("*.py"))
    unused = [w for w in words if w.lower().replace(" ", "_") not in code and w.lower() not in code]
    assert not unused, f"glossary words the code no longer uses: {unused}"
