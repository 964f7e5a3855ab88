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


def imports(tree: ast.Module, module: str = "", is_package: bool = False) -> dict[str, tuple[str, str | None]]:
    """name -> (the module it comes from, its name there), for every import in a file (function bodies too):
    `from X import a as b` gives b -> (X, a); `import X.Y as m` gives m -> (X.Y, None), a module. A relative one
    (`from .x import a`) is resolved against `module`, the importing file's own module (a package's __init__ when
    is_package); one that climbs past the top is left out."""
    here = module.split(".") if module else []
    out: dict[str, tuple[str, str | None]] = {}
    for n in ast.walk(tree):
        if isinstance(n, ast.Import):
            out.update({a.asname: (a.name, None) for a in n.names if a.asname})
            out.update({a.name.split(".")[0]: (a.name.split(".")[0], None) for a in n.names if not a.asname})
            continue
        if not isinstance(n, ast.ImportFrom):
            continue
        source = n.module
        if n.level:
            keep = len(here) - n.level + (1 if is_package else 0)
            if not here or keep < 1:
                continue
            source = ".".join(here[:keep] + ([n.module] if n.module else []))
        if source:
            out.update({a.asname or a.name: (source, a.name) for a in n.names})
    return out


def _is_package(package_dir: Path, module: str) -> bool:
    path = module_file(package_dir, module)
    return path is not None and path.name == "__init__.py"


def find_class(
    package_dir: Path, module: str, name: str, depth: int = 0
) -> tuple[ast.ClassDef, ast.Module, str] | None:
    """(the class, its file's tree, the module defining it), following the imports that re-export it (under an
    alias too); None: not in vLLM's files."""
    tree = parse(module_file(package_dir, module))
    if tree is None or depth > MAX_DEPTH:
        return None
    for n in tree.body:
        if isinstance(n, ast.ClassDef) and n.name == name:
            return n, tree, module
    src, orig = imports(tree, module, _is_package(package_dir, module)).get(name, (None, None))
    return find_class(package_dir, src, orig, depth + 1) if src and orig else None


def base_of(b: ast.expr, names: dict[str, tuple[str, str | None]], where: str) -> tuple[str, str] | None:
    """(module, class name) a class's base expression names: `Base`, `Base[T]`, `mod.Base` or `pkg.mod.Base`
    through the file's imports; a name the file does not import is looked for in the file itself (`where`)."""
    if isinstance(b, ast.Subscript):
        b = b.value
    if isinstance(b, ast.Name):
        src, orig = names.get(b.id, (where, b.id))
        return (src, orig) if orig else None
    parts: list[str] = []
    while isinstance(b, ast.Attribute):
        parts.insert(0, b.attr)
        b = b.value
    if not isinstance(b, ast.Name) or not parts or b.id not in names:
        return None
    src, orig = names[b.id]
    return ".".join([src, *([orig] if orig else []), *parts[:-1]]), parts[-1]


def lookup(package_dir: Path, module: str, cls: str, want: Callable[[ast.ClassDef], Any], depth: int = 0) -> Any:
    """The first of `cls` and its bases (in order, across files) for which want(class node) is not None."""
    found = find_class(package_dir, module, cls)
    if found is None or depth > MAX_DEPTH:
        return None
    node, tree, where = found
    if (got := want(node)) is not None:
        return got
    names = imports(tree, where, _is_package(package_dir, where))
    for b in node.bases:
        if (base := base_of(b, names, where)) is not None:
            if (got := lookup(package_dir, *base, want, depth + 1)) is not None:
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
