"""Exit codes are decided in one module, repro/exit_codes.py: each command's typed outcome gives the code it gave
before the module existed (the numbers below are written out, not read from the module), every code a command can
give is in its row of EXIT_CODES, and docs/exit-codes.md is the module's markdown(). The commands themselves, run
as subprocesses: tests/test_cli_refusals.py, tests/test_cli_without_gpu.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from repro import exit_codes
from repro.exit_codes import EXIT_CODES, Exit
from repro.judge.decision import GateOutcome
from repro.vllm_integration.releases.source_check import BAD, GOOD, NO_KNOWN_BAD, UNTESTABLE

ROOT = Path(__file__).resolve().parent.parent


def test_the_codes_are_the_numbers_scripts_test():
    assert {e.name: int(e) for e in Exit} == {
        "OK": 0,
        "BUG": 1,
        "BAD_INPUT": 2,
        "BLIND": 3,
        "NOT_RUN": 4,
        "UNTESTABLE": 125,
        "ABORT": 128,
        "INTERRUPTED": 130,
    }
    assert f"{Exit.BLIND}" == str(Exit.BLIND) == "3"


@pytest.mark.parametrize(
    "outcome, code",
    [("PASS", 0), ("AFFECTED", 1), ("HARNESS BLIND", 3), ("CANNOT VOUCH", 4)],
)
def test_the_gate_outcome_gives_its_code(outcome, code):
    assert exit_codes.gate(GateOutcome(outcome)) == code
    assert exit_codes.gate(outcome) == code  # the outcome as results.json keeps it
    assert exit_codes.compare_paths(False, GateOutcome(outcome)) == code
    assert exit_codes.compare_paths(True, GateOutcome(outcome)) == 3  # the paths' verdicts differ


def test_every_gate_outcome_has_a_code():
    assert set(exit_codes.GATE) == set(GateOutcome)


@pytest.mark.parametrize(
    "verdicts, code",
    [
        ([GOOD], 0),
        ([BAD], 1),
        ([UNTESTABLE], 125),
        ([GOOD, GOOD], 0),
        ([GOOD, UNTESTABLE], 125),
        ([UNTESTABLE, BAD, GOOD], 1),  # vllm-check: a bad source outweighs an untestable one
    ],
)
def test_source_verdicts_give_bisect_and_vllm_check_codes(verdicts, code):
    assert exit_codes.source(verdicts) == code
    assert exit_codes.source(iter(verdicts)) == code  # a generator, as vllm-check passes them


@pytest.mark.parametrize("gate_code, code", [(0, 0), (1, 1), (2, 125), (3, 125), (4, 125), (125, 125), (130, 125)])
def test_a_gate_bisect_step_passes_good_and_bad_through_and_nothing_else(gate_code, code):
    assert exit_codes.gate_step(gate_code) == code


def test_bisect_gives_0_for_a_first_bad_commit_125_when_only_untestable_ones_were_left_else_1():
    assert exit_codes.bisect("abc123", only_untestable_left=False) == 0
    assert exit_codes.bisect("abc123", only_untestable_left=True) == 0
    assert exit_codes.bisect(None, only_untestable_left=True) == 125
    assert exit_codes.bisect(None, only_untestable_left=False) == 1


def test_matrix_and_the_pytest_gate_give_1_for_a_failed_gate():
    assert exit_codes.matrix(as_expected=True) == 0
    assert exit_codes.matrix(as_expected=False) == 1
    assert exit_codes.matrix(as_expected=True, gate_passed=True) == 0
    assert exit_codes.matrix(as_expected=False, gate_passed=True) == 1
    assert exit_codes.matrix(as_expected=True, gate_passed=False) == 1
    assert exit_codes.gate_decision(True) == 0 and exit_codes.gate_decision(False) == 1
    assert exit_codes.gate_decision(False) == pytest.ExitCode.TESTS_FAILED
    assert exit_codes.pytest_session(pytest.ExitCode.OK, gate_passed=True) == 0
    assert exit_codes.pytest_session(pytest.ExitCode.TESTS_FAILED, gate_passed=True) == 1
    assert exit_codes.pytest_session(pytest.ExitCode.OK, gate_passed=False) == 1
    assert exit_codes.pytest_session(pytest.ExitCode.INTERRUPTED, gate_passed=True) == 130  # never 2 (bad input)


@pytest.mark.parametrize(
    "verdict, code",
    [("clean", 0), ("skip", 4), ("oob", 1), ("crash", 1), ("hang", 1), ("stale-audit", 1), ("error", 1)],
)
def test_run_gives_its_case_verdicts_code(verdict, code):
    assert exit_codes.run(verdict) == code


def test_a_check_gives_0_or_1():
    assert exit_codes.check(True) == 0 and exit_codes.check(False) == 1


def test_every_code_a_command_can_give_is_in_its_row():
    rows = {cmd: set(codes) for cmd, codes in EXIT_CODES.items()}
    bad_input = {Exit.BAD_INPUT}
    assert {exit_codes.gate(o) for o in GateOutcome} | bad_input | {Exit.NOT_RUN} == rows["gate"]
    assert {exit_codes.source([v]) for v in (GOOD, BAD, UNTESTABLE)} | bad_input == rows["vllm-check"]
    assert {exit_codes.bisect(f, u) for f in ("x", None) for u in (True, False)} | bad_input == rows["bisect"]
    step = {exit_codes.source([v]) for v in (GOOD, BAD, UNTESTABLE)} | {exit_codes.gate_step(c) for c in range(256)}
    assert step | {Exit.ABORT} == rows["repro.vllm_integration.releases.bisect step"]  # its bad input stops git
    assert {exit_codes.matrix(e, g) for e in (True, False) for g in (None, True, False)} | bad_input | {
        Exit.NOT_RUN
    } == rows["matrix"]
    assert {exit_codes.run(v) for v in ("clean", "skip", "oob")} | bad_input == rows["run"]
    for cmd in ("agree", "xdist-report"):
        assert {exit_codes.check(x) for x in (True, False)} | bad_input == rows[cmd]


def test_the_exit_codes_page_is_the_modules_markdown():
    page = (ROOT / "docs" / "exit-codes.md").read_text()
    assert exit_codes.markdown() in page, (
        "regenerate docs/exit-codes.md's tables: python -c 'from repro.exit_codes import markdown; print(markdown())'"
    )


def test_every_subcommand_has_its_row():
    from repro.cli import build_parser

    sub = next(a for a in build_parser()._actions if a.dest == "cmd")
    assert set(sub.choices) <= set(EXIT_CODES), set(sub.choices) - set(EXIT_CODES)


def _returned_ints(path: Path) -> list[str]:
    """`return 3`-style statements (a literal int other than None) in a module's functions."""
    tree = ast.parse(path.read_text())
    return [
        f"{path.relative_to(ROOT)}:{n.lineno}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Return) and isinstance(n.value, ast.Constant) and type(n.value.value) is int
    ]


@pytest.mark.parametrize(
    "module",
    [
        "repro/cli/__init__.py",
        "repro/cli/matrix.py",
        "repro/cli/run.py",
        "repro/cli/serve.py",
        "repro/cli/vllm.py",
        "repro/cli/gate.py",
        "repro/cli/reports.py",
        "repro/pytest_options.py",
        "repro/vllm_integration/releases/bisect.py",
    ],
)
def test_the_commands_return_no_code_of_their_own(module):
    """A command module returns what repro.exit_codes decided, never a number it wrote itself."""
    assert not _returned_ints(ROOT / module)


def test_the_readme_quotes_the_codes_the_module_decides():
    readme = (ROOT / "README.md").read_text()
    gate_line = next(ln for ln in readme.splitlines() if ln.startswith("python -m repro gate "))
    for outcome in GateOutcome:
        assert f"{exit_codes.gate(outcome)} {outcome}" in gate_line, (outcome, gate_line)
    check_line = next(ln for ln in readme.splitlines() if ln.startswith("python -m repro vllm-check "))
    # 0 is "no known bad pattern" (the source check cannot vouch: `good` only with a GPU record), 1 bad
    for verdict, words in ((NO_KNOWN_BAD, "no known bad pattern"), (BAD, "bad")):
        assert f"{exit_codes.source([verdict])} {words}" in check_line, (verdict, check_line)
    assert exit_codes.source([GOOD]) == exit_codes.source([NO_KNOWN_BAD])
    assert f"{exit_codes.source([UNTESTABLE])} untestable" in check_line
    short = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    assert all(f"**{int(code)}**" in short for code in Exit if code != Exit.INTERRUPTED), short
