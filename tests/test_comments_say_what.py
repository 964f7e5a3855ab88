"""The code's comments and docstrings say what and why, never when: no date and no issue number in a comment or a
docstring of repro/, cases/, tests/ or conftest.py (that history is in docs/history.md and results/README.md). A date a
program reads or writes (a string it compares, a record's field) is code, not a comment, and is not looked at."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEN = re.compile(r"\b20\d\d-\d\d-\d\d\b|\b[Ii]ssues? #?\d+|\b[Ii]ssue #\d+")


def _files() -> list[Path]:
    return [p for d in ("repro", "cases", "tests") for p in sorted((ROOT / d).rglob("*.py"))] + [ROOT / "conftest.py"]


def narrating(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comment and docstring that names a date or an issue number."""
    found = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT and WHEN.search(t.string)
    ]
    for node in ast.walk(ast.parse(source)):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            doc = body[0].value
            if isinstance(doc, ast.Constant) and isinstance(doc.value, str) and WHEN.search(doc.value):
                found.append((doc.lineno, WHEN.search(doc.value).group(0)))
    return sorted(found)


def test_the_finder_finds_a_date_or_an_issue_in_a_comment_or_docstring_and_nothing_in_code():
    src = '"""Added for issue 26."""\nx = "2026-12-04"  # a string the code reads\ny = 1  # recorded since 2026-12-04\n'
    assert [line for line, _ in narrating(src)] == [1, 3]
    assert narrating('def f():\n    """What it does, and why."""\n    return "issue 7"\n') == []


def test_no_comment_or_docstring_of_the_code_says_when():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {text[:80]}"
        for path in _files()
        for line, text in narrating(path.read_text())
    ]
    assert not found, "comments that narrate history (move it to docs/history.md):\n" + "\n".join(found)
