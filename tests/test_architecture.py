"""docs/architecture.md lists every module of repro/ and nothing else, and repro's modules import each other at top
level without a circle (an import inside a function, or under `if TYPE_CHECKING:`, runs later or never)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


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


def _top_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """The import statements that run when the module is imported: module level, inside if/try/with and class
    bodies, never inside a function or an `if TYPE_CHECKING:` block."""
    found: list[ast.Import | ast.ImportFrom] = []

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            elif isinstance(node, ast.If) and _type_checking(node):
                walk(node.orelse)
            else:
                for field in ("body", "orelse", "finalbody"):
                    walk(getattr(node, field, None) or [])
                for handler in getattr(node, "handlers", None) or []:
                    walk(handler.body)

    walk(tree.body)
    return found


def import_graph() -> dict[str, set[str]]:
    """repro module -> the repro modules it imports at top level."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _top_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
                continue
            base = node.module or ""
            if node.level:  # relative: from . import x, from ..y import z
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:  # `from repro import case` imports the module repro.case
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


def test_no_import_circle_among_repro_modules():
    graph = import_graph()
    assert graph["repro.runner"] >= {"repro.case", "repro.classify", "repro.executor", "repro.process"}  # it reads
    cycle = find_cycle(graph)
    assert cycle is None, "import circle at top level: " + " -> ".join(cycle)


def test_the_circle_finder_finds_circles():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"a"}}) == ["a", "a"]


def test_imports_inside_functions_and_type_checking_blocks_are_not_top_level():
    tree = ast.parse(
        "import os\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import repro.case\nelse:\n    import json\n"
        "try:\n    import repro.tags\nexcept ImportError:\n    import repro.verdicts\n"
        "def f():\n    import repro.runner\nclass C:\n    import repro.policy\n"
    )
    names = [a.name for n in _top_level_imports(tree) if isinstance(n, ast.Import) for a in n.names]
    assert names == ["os", "json", "repro.tags", "repro.verdicts", "repro.policy"]


def test_architecture_lists_every_module_and_only_modules_that_exist():
    text = DOC.read_text()
    listed = set(re.findall(r"`(repro/[\w/]+\.py)`", text))
    files = {p.relative_to(ROOT).as_posix() for p in (ROOT / "repro").rglob("*.py") if p.name != "__init__.py"}
    assert not files - listed, f"modules missing from docs/architecture.md: {sorted(files - listed)}"
    assert not listed - files, f"docs/architecture.md lists modules that do not exist: {sorted(listed - files)}"
    folders = set(re.findall(r"`(repro/[\w/]+)/`", text))
    assert all((ROOT / f).is_dir() for f in folders), sorted(f for f in folders if not (ROOT / f).is_dir())
