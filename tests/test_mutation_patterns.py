"""The mutation check (tests/mutation_check.py, run by hand: it reruns test files per mutation) stays runnable: every
mutation of every set names text that occurs exactly once in today's source, so a change to a rule's line shows here,
in the CPU tier, instead of as a silent "matched 0 times" the next time someone runs the check."""

from __future__ import annotations

import re

import pytest

from tests import mutation_check

MUTATIONS = [(which, m) for which, (_, ms) in mutation_check.SETS.items() for m in ms]


@pytest.mark.parametrize("which, mutation", MUTATIONS, ids=[f"{w}: {m[0]}" for w, m in MUTATIONS])
def test_every_mutation_names_its_rule_once_in_todays_source(which, mutation):
    name, rel, old, new, regex, want = mutation
    src = (mutation_check.ROOT / rel).read_text()
    n = len(re.findall(old, src, flags=re.S)) if regex else src.count(old)
    assert n == 1, f"{which}: {name}: matched {n} times in {rel}"
    assert want, f"{which}: {name}: names no test that must fail"
