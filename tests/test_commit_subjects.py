"""Commit subjects stay short: every commit after BASE (the commit from which the rule holds) has a subject of at most
72 characters, the detail in its body. Checked on the project's own history, so CI's clean clone checks every new
commit; skipped, with the reason, where there is no history to read (no git, not a checkout, a shallow clone without
BASE)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASE = "173573a"  # the last commit before the rule; the commits after it are held to it
MAX_SUBJECT = 72
# commits made on branches that ran beside the one that brought this check, before it reached main: their subjects
# were written before the rule could be checked, and rewriting merged history would change every later hash
BEFORE_THE_CHECK = frozenset(
    {"7eaab04", "ccfb83c", "d304529", "e322054", "4c84ad9", "e7fd1ce", "6729d7f", "6d45b60", "8b9751f", "95552f5"}
    | {"2ffc27f", "15c7e45"}
)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=60)


def long_subjects(log: str, limit: int = MAX_SUBJECT, exempt: frozenset[str] = frozenset()) -> list[str]:
    """The `hash subject` lines of `git log --format='%h %s'` whose subject is longer than limit (but `exempt`)."""
    out = []
    for line in log.splitlines():
        sha, _, subject = line.partition(" ")
        if len(subject) > limit and sha[:7] not in exempt:
            out.append(f"{sha} ({len(subject)} characters): {subject[:80]}...")
    return out


def test_the_check_finds_a_subject_over_72_characters_and_passes_one_of_72():
    assert long_subjects("abc1234 " + "x" * 72) == []
    assert long_subjects("abc1234 " + "x" * 73) == [f"abc1234 (73 characters): {'x' * 73}..."]
    assert long_subjects("abc1234 short\ndef5678 " + "y" * 100)[0].startswith("def5678 (100 characters)")


def test_the_commits_before_the_base_would_fail_the_rule():
    """The rule is new: the history before BASE breaks it (its median subject was over 200 characters), so the check
    below reads the real log (where the history exists) and is not vacuous."""
    if shutil.which("git") is None or _git("cat-file", "-e", f"{BASE}~3^{{commit}}").returncode != 0:
        pytest.skip(f"no history before {BASE} here (no git, not a checkout, or a shallow clone)")
    r = _git("log", "--format=%h %s", f"{BASE}~3..{BASE}")
    assert len(long_subjects(r.stdout)) == 3, r.stdout


def test_every_commit_after_the_base_has_a_subject_of_72_characters_or_fewer():
    if shutil.which("git") is None:
        pytest.skip("git is not installed: no history to read the commit subjects from")
    if _git("rev-parse", "--git-dir").returncode != 0:
        pytest.skip(f"{ROOT} is not a git checkout: no history to read the commit subjects from")
    if _git("cat-file", "-e", f"{BASE}^{{commit}}").returncode != 0:
        pytest.skip(f"the base commit {BASE} is not in this clone's history (a shallow clone?): git fetch --unshallow")
    r = _git("log", "--format=%h %s", "--abbrev=7", f"{BASE}..HEAD")
    assert r.returncode == 0, r.stderr
    long = long_subjects(r.stdout, exempt=BEFORE_THE_CHECK)
    assert not long, "commit subjects over 72 characters (the detail goes in the body):\n" + "\n".join(long)


def test_the_exempt_commits_are_only_those_written_before_the_check():
    """Each exempt commit exists and breaks the rule (an exemption that hides nothing is dropped, never kept)."""
    if shutil.which("git") is None or _git("cat-file", "-e", f"{BASE}^{{commit}}").returncode != 0:
        pytest.skip(f"no history with {BASE} here (no git, not a checkout, or a shallow clone)")
    for sha in BEFORE_THE_CHECK:
        r = _git("log", "-1", "--format=%s", sha)
        assert r.returncode == 0 and len(r.stdout.strip()) > MAX_SUBJECT, (sha, r.stdout, r.stderr)
