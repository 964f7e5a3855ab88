"""README is a front page: it links to every page under docs/, and every relative link in README and docs/ names a
file that exists (the reference pages moved out of README must stay reachable from it)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _links(page: Path) -> set[Path]:
    return {(page.parent / m).resolve() for m in LINK.findall(page.read_text()) if "://" not in m}


def test_readme_links_to_every_docs_page():
    linked = _links(ROOT / "README.md")
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked)
    assert not missing, f"README.md links to no docs/{missing}"


def test_every_relative_link_names_a_file_that_exists():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        broken = sorted(str(p) for p in _links(page) if not p.exists())
        assert not broken, f"{page.name} links to missing files: {broken}"


def test_the_first_screen_answers_is_my_build_affected_on_both_kinds_of_machine():
    first = "\n".join((ROOT / "README.md").read_text().splitlines()[:30])
    assert "python -m repro vllm-check" in first and "python -m repro gate" in first
