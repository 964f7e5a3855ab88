"""A vLLM build's classes read from its Python files, never imported: a module's file in the package tree, the names a
file imports and from where (relative imports resolved against the importing module), a class found through the
imports that re-export it, and the first of a class and its bases (across files) that answers a question. A module
outside vLLM (abc, torch, typing) or a file that is missing or does not parse ends the search with None: a build's
files that do not say are never an error (gate.methods reads what a method's speculator is and does through these).
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_DEPTH = 8  # re-exports or bases followed, at most


def parse(path: Path | None) -> ast.Module | None:
    """A file's syntax tree; None for no file, one that cannot be read or does not parse."""
    if path is None:
        return None
    try:
        return ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError):
        return None


def module_file(package_dir: Path, module: str) -> Path | None:
    """vllm.a.b -> <package_dir>/a/b.py, else its package's a/b/__init__.py; None for a module outside vLLM."""
    parts = module.split(".")
    if parts[0] != "vllm" or not all(parts):
        return None
    rel = Path(*parts[1:]) if parts[1:] else None
    if rel is not None and (package_dir / rel.with_suffix(".py")).exists():
        return package_dir / rel.with_suffix(".py")
    return (package_dir / rel if rel is not None else package_dir) / "__init__.py"


def strings(node: ast.AST) -> list[str]:
    """Every string constant under a node, in order."""
    return [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def imports(tree: ast.Module, module: str = "", is_package: bool = False) -> dict[str, str]:
    """name -> the module it is imported from, for every `from X import name` in a file (function bodies too); a
    relative one (`from .x import name`) resolved against `module`, the importing file's own module (a package's
    __init__ when is_package); one that climbs past the top is left out."""
    here = module.split(".") if module else []
    out = {}
    for n in ast.walk(tree):
        if not isinstance(n, ast.ImportFrom):
            continue
        source = n.module
        if n.level:
            keep = len(here) - n.level + (1 if is_package else 0)
            if not here or keep < 1:
                continue
            source = ".".join(here[:keep] + ([n.module] if n.module else []))
        if source:
            out.update({a.asname or a.name: source for a in n.names})
    return out


def find_class(
    package_dir: Path, module: str, name: str, depth: int = 0
) -> tuple[ast.ClassDef, ast.Module, str] | None:
    """(the class, its file's tree, the module defining it), following the imports that re-export it; None: not in
    vLLM's files."""
    path = module_file(package_dir, module)
    tree = parse(path)
    if tree is None or depth > MAX_DEPTH:
        return None
    for n in tree.body:
        if isinstance(n, ast.ClassDef) and n.name == name:
            return n, tree, module
    src = imports(tree, module, path is not None and path.name == "__init__.py").get(name)
    return find_class(package_dir, src, name, depth + 1) if src else None


def lookup(package_dir: Path, module: str, cls: str, want: Callable[[ast.ClassDef], Any], depth: int = 0) -> Any:
    """The first of `cls` and its bases (in order, across files) for which want(class node) is not None."""
    found = find_class(package_dir, module, cls)
    if found is None or depth > MAX_DEPTH:
        return None
    node, tree, where = found
    if (got := want(node)) is not None:
        return got
    names = imports(tree, where, (module_file(package_dir, where) or Path()).name == "__init__.py")
    for b in node.bases:
        base = ast.unparse(b).split(".")[-1]
        got = lookup(package_dir, names.get(base, where), base, want, depth + 1)
        if got is not None:
            return got
    return None


def assigned(node: ast.ClassDef, attr: str) -> str | None:
    """The strings a class body assigns to `attr` ("None" for a non-string value), None where it assigns none."""
    for n in node.body:
        targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(n, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == attr for t in targets) and n.value is not None:
            value = "".join(strings(n.value))
            return value or "None"
    return None
