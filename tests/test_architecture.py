"""docs/architecture.md lists every module of repro/ and nothing else; repro's modules import each other without a
circle, counting the imports inside functions (they run later, but they run: a circle through one still means two
modules that each need the other); every import inside a function says why on its line; no module is over 400
lines. An import under `if TYPE_CHECKING:` never runs and is not counted."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module and package of repro/."""
    out = {}
    for p in sorted((ROOT / "repro").rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module, inside_functions: bool) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run: those at import time (module level, inside if/try/with and class bodies) and,
    with inside_functions, those in function bodies too; never one inside an `if TYPE_CHECKING:` block."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if inside_functions:
                    walk(node.body)
            elif isinstance(node, ast.If) and _type_checking(node):
                walk(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody"):
                    walk(getattr(node, field, None) or [])
                for handler in getattr(node, "handlers", None) or []:
                    walk(handler.body)
                for case in getattr(node, "cases", None) or []:
                    walk(case.body)

    walk(tree.body)
    return found


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return _imports(tree, inside_functions=False)


def _function_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The imports that run only when a function runs."""
    top = {id(n) for n in _top_level_imports(tree)}
    return [n for n in _imports(tree, inside_functions=True) if id(n) not in top]


REGISTRY = "repro.entrypoints"  # the one module that names project modules as strings


def _named(value: str, mods) -> str | None:
    """The project module a string names ("repro.x.y", or "repro.x.y:attribute"), else None."""
    module, colon, attr = value.partition(":")
    if module == "repro":  # the program's name (`python -m repro`), not a module another imports
        return None
    return module if module in mods and (not colon or attr.isidentifier()) else None


def registry_names() -> dict[str, set[str]]:
    """Each constant of repro.entrypoints -> the project modules its value names (strings, tuples, dicts' values)."""
    import importlib  # noqa: PLC0415  only the registry's values are read by importing it

    reg, mods = importlib.import_module(REGISTRY), _modules()

    def strings(v) -> list[str]:
        if isinstance(v, str):
            return [v]
        if isinstance(v, dict):
            v = list(v.values())
        return [x for item in v for x in strings(item)] if isinstance(v, (tuple, list, frozenset, set)) else []

    return {k: {m for x in strings(getattr(reg, k)) if (m := _named(x, mods))} for k in dir(reg) if k.isupper()}


def _registry_uses(tree: ast.Module) -> set[str]:
    """The registry's names a module uses: `entrypoints.NAME`, or `from repro.entrypoints import NAME`."""
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "entrypoints":
            used.add(node.attr)
        elif isinstance(node, ast.ImportFrom) and node.module == REGISTRY:
            used |= {a.name for a in node.names}
    return used


def import_graph(inside_functions: bool = True) -> dict[str, set[str]]:
    """repro module -> the repro modules it imports (at top level and, with inside_functions, in its functions), and
    those it names through the registry (repro.entrypoints: started as a process, imported by name)."""
    mods = _modules()
    named = registry_names()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        for used in _registry_uses(tree):
            targets |= named.get(used, set())
        for node in _imports(tree, inside_functions):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # `from repro.cli import matrix` imports the module repro.cli.matrix
                targets.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
        graph[name] = {t for t in targets if t in mods and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


CODES = re.compile(r"noqa(:\s*[A-Z]+[0-9]+(\s*,\s*[A-Z]+[0-9]+)*)?|type:\s*ignore(\[[^\]]*\])?")


def reason(source: str, node: ast.stmt) -> str:
    """The words of the comments on an import's lines, lint codes (noqa, type: ignore) taken out; "" when none."""
    comments = [
        tok.string
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and node.lineno <= tok.start[0] <= (node.end_lineno or node.lineno)
    ]
    return " ".join(CODES.sub("", c.lstrip("#")).strip(" #") for c in comments).strip()


def test_no_import_circle_among_repro_modules_counting_imports_inside_functions():
    graph = import_graph()
    assert graph["repro.run.runner"] >= {
        "repro.case.spec",
        "repro.judge.classify",
        "repro.run.executor",
        "repro.run.process",
    }  # it reads
    assert "repro.fa3_model.predict" in graph["repro.judge.expectations"]  # inside a function: counted
    cycle = find_cycle(graph)
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_every_import_inside_a_function_says_why_on_its_line():
    missing = []
    for path in _modules().values():
        source = path.read_text()
        for node in _function_imports(ast.parse(source, str(path))):
            if not reason(source, node):
                missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.get_source_segment(source, node)}")
    assert not missing, "imports inside a function without a reason on their line:\n" + "\n".join(missing)


def test_no_module_over_400_lines():
    long = {
        p.relative_to(ROOT).as_posix(): n
        for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"


def test_the_circle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


SAMPLE = (
    "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import repro.case.spec\nelse:\n    import json\n"
    "try:\n    import repro.contract.tags\nexcept ImportError:\n    import repro.contract.verdicts\n"
    "def f():\n    import repro.run.runner  # noqa: PLC0415  torch only here\n    if True:\n        import repro.attention.worker  # noqa: F401\n"
    "class C:\n    import repro.judge.policy\n    def g(self):\n        from repro import (  # the CPU model\n            report,\n        )\n"
)


def test_imports_inside_functions_and_type_checking_blocks_are_not_top_level():
    names = [a.name for n in _top_level_imports(ast.parse(SAMPLE)) if isinstance(n, ast.Import) for a in n.names]
    assert names == ["os", "json", "repro.contract.tags", "repro.contract.verdicts", "repro.judge.policy"]


def test_imports_inside_functions_are_found_with_their_reasons():
    tree = ast.parse(SAMPLE)
    found = [(ast.get_source_segment(SAMPLE, n).split()[1], reason(SAMPLE, n)) for n in _function_imports(tree)]
    assert found == [
        ("repro.run.runner", "torch only here"),
        ("repro.attention.worker", ""),
        ("repro", "the CPU model"),
    ]


def _listed_files() -> set[str]:
    """Every module file the table must list: each .py file of repro/, and an __init__.py that holds more than a
    docstring (a package's own code)."""
    out = set()
    for p in (ROOT / "repro").rglob("*.py"):
        body = ast.parse(p.read_text()).body
        if p.name == "__init__.py" and all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body):
            continue
        out.add(p.relative_to(ROOT).as_posix())
    return out


def test_architecture_lists_every_module_and_only_modules_that_exist():
    text = DOC.read_text()
    listed = set(re.findall(r"`(repro/[\w/]+\.py)`", text))
    files = _listed_files()
    assert not files - listed, f"modules missing from docs/architecture.md: {sorted(files - listed)}"
    assert not listed - files, f"docs/architecture.md lists modules that do not exist: {sorted(listed - files)}"
    folders = set(re.findall(r"`(repro/[\w/]+)/`", text))
    assert all((ROOT / f).is_dir() for f in folders), sorted(f for f in folders if not (ROOT / f).is_dir())


def _contract() -> dict:
    """The import-linter layers contract of pyproject.toml (the layers `lint-imports` checks in CI)."""
    import pytest  # noqa: PLC0415  only these tests skip

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return next(
        c
        for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
        if c["type"] == "layers"
    )


def _doc_layers() -> list[set[str]]:
    """docs/architecture.md's layer table, top to bottom: each row's packages and modules as dotted names."""
    text = DOC.read_text()
    table = text[text.index("<!-- layers:") : text.index("<!-- /layers -->")]
    rows = [line.split("|")[2] for line in table.splitlines() if line.startswith("| ") and "`repro/" in line]
    return [
        {re.sub(r"\.py$", "", p.rstrip("/")).replace("/", ".") for p in re.findall(r"`(repro/[\w/.]*)`", cell)}
        for cell in rows
    ]


def test_the_layer_table_is_the_import_contract_in_its_order():
    layers = [{x.strip() for x in layer.split("|")} for layer in _contract()["layers"]]
    assert layers == _doc_layers(), "docs/architecture.md's layer table and pyproject.toml's contract differ"


def test_every_module_but_the_package_itself_is_in_one_layer_of_the_contract():
    layers = [x.strip() for layer in _contract()["layers"] for x in layer.split("|")]
    outside = {
        m
        for m in _modules()
        if m not in ("repro", "repro.vllm_integration") and not any(m == L or m.startswith(L + ".") for L in layers)
    }
    assert not outside, f"modules in no layer of the import contract: {sorted(outside)}"


def test_the_attention_layer_imports_nothing_of_the_spec_decode_layer_above_it():
    """The debt the contract ignored until it was paid: the attention worker ran the spec-decode case (now
    repro.specdecode.worker runs it around the attention worker's main). Counted with imports inside functions and
    the names the registry gives."""
    graph = import_graph()
    up = {f"{m} -> {t}" for m, ts in graph.items() if m.startswith("repro.attention") for t in ts if "specdecode" in t}
    assert not up, f"the attention layer imports the spec-decode layer: {sorted(up)}"


def test_every_debt_the_contract_ignores_is_an_import_that_exists():
    """An ignored import that is gone must leave the list (the debt was paid), so the list stays the debts of today."""
    graph = import_graph()
    gone = [
        entry
        for entry in _contract().get("ignore_imports", [])
        if (pair := [x.strip() for x in entry.split("->")]) and pair[1] not in graph.get(pair[0], set())
    ]
    assert not gone, f"the contract ignores imports that no longer exist: {gone}"


def _defines(path: Path, name: str) -> bool:
    """Does the module define `name` at its top level (a class, a function, or an assignment)?"""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return True
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for t in targets:
            if name in {n.id for n in ast.walk(t) if isinstance(n, ast.Name)}:
                return True
    return False


def test_every_name_the_doc_places_in_a_module_is_defined_there():
    """`module.py` (NAME...) in docs/architecture.md says NAME lives in that module (LATE_VARS once was placed in
    launch.py, defined in forkserver.py): each such name, CamelCase, CAPS or with an underscore, is defined there."""
    text = DOC.read_text()
    wrong, checked = [], 0
    for m in re.finditer(r"`?((?:repro/)?[\w/]+\.py)`?[^\w`(]{0,3}\(([A-Za-z_][A-Za-z0-9_]*)[:,) ]", text):
        rel, name = m.group(1), m.group(2)
        if not ("_" in name or (name[0].isupper() and len(name) > 2)):
            continue  # a word, not a name
        path = ROOT / (rel if rel.startswith("repro/") else f"repro/{rel}")
        checked += 1
        if not path.exists() or not _defines(path, name):
            wrong.append(f"{rel}: {name}")
    assert checked >= 10 and not wrong, f"docs/architecture.md places names where they are not defined: {wrong}"


def test_each_cli_module_holds_the_subcommands_its_row_names():
    """The module table's row of each cli module names, in backticks, exactly the subcommands it registers."""
    import argparse  # noqa: PLC0415  only this test builds parsers

    from repro import cli  # noqa: PLC0415  the cli imports much: only this test needs it

    rows = dict(re.findall(r"^\| `repro/cli/(\w+)\.py` \| (.*) \|$", DOC.read_text(), re.M))
    for name in ("matrix", "run", "serve", "vllm", "reports", "plugin"):
        sub = argparse.ArgumentParser().add_subparsers()
        getattr(cli, name).add_parsers(sub)
        named = set(re.findall(r"`([a-z][a-z-]*)`", rows[name].split(":")[0]))
        assert named == set(sub.choices), f"repro/cli/{name}.py registers {sorted(sub.choices)}, its row names {named}"


def test_no_module_but_exit_codes_writes_an_exit_code_as_a_number():
    """docs/architecture.md: every command's code for its outcome comes from repro/exit_codes.py: no other module
    returns from a command or exits with a non-zero number of its own."""
    found = []
    for name, path in _modules().items():
        if name == "repro.exit_codes":
            continue
        tree = ast.parse(path.read_text())
        for fn in (n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)):
            command = fn.name == "main" or fn.name.startswith("cmd_")
            for node in ast.walk(fn):
                value = None
                if isinstance(node, ast.Return) and command:
                    value = node.value
                elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("sys.exit", "SystemExit"):
                    value = node.args[0] if node.args else None
                if isinstance(value, ast.Constant) and isinstance(value.value, int) and value.value not in (0, None):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    # known debts, each a process's own code no command returns, named by the doc (the forkserver's refusal, read by
    # its REFUSED record, and the release-facts recorder's bad input; tests/test_architecture_claims.py keeps the
    # doc's list equal to the modules that do)
    said = re.search(r"no other command's module writes a code as a\s+number; (.*?)\)\n", DOC.read_text(), re.S)
    debts = {f"repro/{p}" for p in re.findall(r"([\w/]+\.py)", said.group(1))} if said else set()
    found = [f for f in found if f.split(":")[0] not in debts]
    assert not found, f"exit codes written as numbers outside repro/exit_codes.py: {found}"


BY_NAME_CALLS = ("importlib.import_module", "import_module", "__import__", "importlib.util.find_spec", "find_spec")
# modules that import by a name no project module has: vLLM's attention backends named in BACKENDS' table
THIRD_PARTY_BY_NAME = {"repro.vllm_integration.plugin"}
# a string equal to a module's name that names no import: the CPU model's backend identity
LABELS = {("repro.fa3_model.predict", "repro.fa3_model")}


def _docstrings(tree: ast.Module) -> set[int]:
    return {
        id(body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and (body := node.body)
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
    }


def test_no_project_module_is_named_as_a_string_outside_the_registry():
    """`python -m repro.x`, importlib.import_module("repro.x"), find_spec: only repro/entrypoints.py names a project
    module as a string (the cycle test counts its names); nowhere else does a module import one by name."""
    mods, found = _modules(), []
    for name, path in mods.items():
        if name == REGISTRY:
            continue
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if (m := _named(node.value, mods)) and (name, m) not in LABELS:
                    found.append(f"{where}: {node.value!r}")
            elif isinstance(node, ast.Call) and ast.unparse(node.func) in BY_NAME_CALLS and node.args:
                arg = node.args[0]
                constant = isinstance(arg, ast.Constant) and not str(arg.value).startswith("repro")
                if not constant and name not in THIRD_PARTY_BY_NAME:
                    found.append(f"{where}: {ast.unparse(node)}")
    assert not found, "project modules named as strings outside repro/entrypoints.py:\n" + "\n".join(found)


def test_the_cycle_test_sees_the_modules_named_through_the_registry():
    graph = import_graph()
    assert "repro.attention.worker" in graph["repro.run.runner"]  # started as `python -m`, or its main forked
    assert "repro.vllm_integration.gate.worker" in graph["repro.vllm_integration.gate.process"]
    assert "repro.run.forkserver" in graph["repro.run.forkclient"]  # the one forkserver, started by its client
    assert "repro.vllm_integration.releases.builds" in graph["repro.vllm_integration.gate.forkserver"]  # --setup
    assert {"repro.attention.worker", "repro.backends.preload"} <= graph["repro.run.executor"]  # its preload
    names = registry_names()
    assert names["GATE_PRELOAD"] == {"repro.contract.channel", "repro.vllm_integration.plugin", GATE_WORKER}
    assert all(names.values()), [k for k, v in names.items() if not v]  # every name names a module


GATE_WORKER = "repro.vllm_integration.gate.worker"


def _project_sources() -> list[Path]:
    """Every Python file of the project that imports repro: the package, the tests, the GPU cases, the scripts."""
    found = [p for d in ("repro", "tests", "cases", "scripts") for p in sorted((ROOT / d).rglob("*.py"))]
    return found + [ROOT / "conftest.py"]


def test_every_import_of_repro_in_the_project_names_a_module_that_exists():
    """No old module path is imported anywhere (tests, cases, scripts, the package): each `import repro.x` and
    `from repro.x import y` names a module of repro/ itself, never a name kept for code that has not moved."""
    mods = _modules()
    wrong = set()
    for path in _project_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            wrong |= {f"{path.relative_to(ROOT)}: {n}" for n in names if n.startswith("repro") and n not in mods}
    assert not wrong, f"imports of modules that do not exist: {sorted(wrong)}"


def test_no_module_stands_in_for_another_through_sys_modules():
    """One name per module: no module of repro/ replaces itself in sys.modules with another (an alias for an old
    path), so a monkeypatch and an import always reach the module the doc's table names."""
    aliases = [
        str(p.relative_to(ROOT))
        for p in _modules().values()
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "sys.modules"
    ]
    assert not aliases, f"modules that alias themselves in sys.modules: {aliases}"


def _type_checking_imports(tree: ast.Module) -> list[str]:
    """The modules imported under `if TYPE_CHECKING:` anywhere in a module."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _type_checking(node):
            for stmt in node.body:
                for n in ast.walk(stmt):
                    if isinstance(n, ast.Import):
                        out += [a.name for a in n.names]
                    elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                        out.append(n.module)
    return out


def test_no_import_runs_up_the_layers_not_even_for_type_checking():
    """The contract counts the imports under `if TYPE_CHECKING:` too (pyproject.toml: exclude_type_checking_imports
    false), and no such import names a module of a layer above its own: 0 arrows back up."""
    import pytest  # noqa: PLC0415  only these tests skip

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    linter = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert linter.get("exclude_type_checking_imports") is False
    layers = [[x.strip() for x in layer.split("|")] for layer in _contract()["layers"]]

    def level(module: str) -> int | None:
        hits = [i for i, names in enumerate(layers) for L in names if module == L or module.startswith(L + ".")]
        return hits[0] if hits else None

    up = []
    for name, path in _modules().items():
        for target in _type_checking_imports(ast.parse(path.read_text())):
            a, b = level(name), level(target)
            if a is not None and b is not None and b < a:
                up.append(f"{name} -> {target}")
    assert not up, f"type-checking imports up the layers: {up}"
