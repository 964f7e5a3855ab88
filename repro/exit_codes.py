"""Every command's exit code, decided in this one module from the command's typed outcome: `repro gate` (and its
`--compare-paths`) from repro.judge.decision.GateOutcome, `matrix --gate` and `pytest --gate` from the policy's
decision (GateDecision.passed), `bisect`, its step and `vllm-check` from the source check's verdicts and git
bisect's answer, `run` from its case's verdict. Bad input is ConfigError (repro.errors) wherever it is raised:
repro.cli.main turns it into one line and BAD_INPUT.

EXIT_CODES says what each code means in each command; docs/exit-codes.md shows `markdown()` (a CPU test keeps the
page equal to it, and every code a function below can return listed for its command)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from enum import IntEnum

from repro.contract.verdicts import CLEAN, SKIP
from repro.contract.verdicts import SOURCE_BAD as BAD
from repro.contract.verdicts import SOURCE_GOOD as GOOD
from repro.contract.verdicts import SOURCE_NO_KNOWN_BAD as NO_KNOWN_BAD
from repro.judge.decision import GateOutcome


class Exit(IntEnum):
    """An exit code: an int that prints as its number. The same meaning in every command."""

    OK = 0  # clean, as expected
    BUG = 1  # the bug is visible, or an expectation failed
    BAD_INPUT = 2  # bad input: one line on stderr, nothing written
    BLIND = 3  # gate only: HARNESS BLIND, a known-bad control came back clean (or none ran)
    NOT_RUN = 4  # could not run here (no GPU, no MPS, no vLLM build...): neither clean nor affected
    UNTESTABLE = 125  # bisect and vllm-check only: git bisect's "skip this commit" (the source cannot be judged)
    ABORT = 128  # the bisect step's bad input: over 127, `git bisect run` stops (2 would read as "bad" at every commit)
    INTERRUPTED = 130  # Ctrl-C

    __str__ = int.__repr__
    __format__ = int.__format__


class Parser(argparse.ArgumentParser):
    """An argument parser whose bad input is one line on stderr and BAD_INPUT (every command's, bisect's step too)."""

    def error(self, message: str):
        sys.stderr.write(f"repro: error: {message}\n")
        raise SystemExit(Exit.BAD_INPUT)


MEANING = {
    Exit.OK: "clean / as expected",
    Exit.BUG: "the bug is visible (or an expectation failed)",
    Exit.BAD_INPUT: "bad input (one line on stderr, nothing written)",
    Exit.BLIND: "HARNESS BLIND (`gate`: a known-bad control came back clean, or none ran)",
    Exit.NOT_RUN: "could not run here (no GPU, no MPS, no vLLM build: one line, before any case runs)",
    Exit.UNTESTABLE: 'untestable (`bisect`, `vllm-check` and the bisect step: git bisect\'s "skip this commit")',
    Exit.ABORT: "the bisect step's bad input: `git bisect run` stops there (any code over 127 aborts it)",
    Exit.INTERRUPTED: "interrupted (Ctrl-C)",
}

# `repro gate`'s outcome -> its exit code. A bisect step over a gate command passes 0 and 1 through, the rest is
# untestable (gate_step).
GATE = {
    GateOutcome.PASS: Exit.OK,
    GateOutcome.AFFECTED: Exit.BUG,
    GateOutcome.BLIND: Exit.BLIND,
    GateOutcome.CANNOT_VOUCH: Exit.NOT_RUN,
}


def gate(outcome: GateOutcome) -> Exit:
    """`repro gate`: PASS 0, AFFECTED 1, HARNESS BLIND 3, CANNOT VOUCH 4."""
    return GATE[GateOutcome(outcome)]


# `repro audit`'s answer -> its exit code (no known-bad control runs there: never HARNESS BLIND)
AUDIT = {GateOutcome.PASS: Exit.OK, GateOutcome.AFFECTED: Exit.BUG, GateOutcome.CANNOT_VOUCH: Exit.NOT_RUN}


def audit(outcome: GateOutcome, command_failed: bool = False, command_must_pass: bool = False) -> Exit:
    """`repro audit`: PASS 0, AFFECTED 1, CANNOT VOUCH 4, whatever the command's own status; with --command-must-pass
    a clean audit of a command that failed is 1 (its status named beside it)."""
    code = AUDIT[GateOutcome(outcome)]
    return Exit.BUG if code == Exit.OK and command_failed and command_must_pass else code


def pytest_audit(status: int, failed: bool) -> int:
    """`pytest --repro-audit`: pytest's own status, or 1 when the audit failed the session (a stale capture found
    after its test ended, a process that never reported, nothing judged in the whole session)."""
    return gate_decision(False) if failed and status == Exit.OK else status


def compare_paths(verdicts_differ: bool, last: GateOutcome) -> Exit:
    """`gate --compare-paths`: HARNESS BLIND when a case's verdict differs between the paths (the new path cannot
    stand in for the old), else the last path's gate outcome."""
    return Exit.BLIND if verdicts_differ else gate(last)


def gate_decision(passed: bool) -> Exit:
    """The policy's decision as `matrix --gate` and `pytest --gate` give it (pytest: its TESTS_FAILED, 1)."""
    return Exit.OK if passed else Exit.BUG


PYTEST_INTERRUPTED = 2  # pytest's ExitCode.INTERRUPTED: the code this project gives bad input


def pytest_session(status: int, gate_passed: bool) -> int:
    """`pytest --gate`: 130 after Ctrl-C (pytest's own 2 would read as bad input), pytest's own status when the
    gate passed, else 1 (a failed gate fails the session)."""
    if status == PYTEST_INTERRUPTED:
        return Exit.INTERRUPTED
    return status if gate_passed else gate_decision(False)


def matrix(as_expected: bool, gate_passed: bool | None = None) -> Exit:
    """`matrix`: 0 when every case came back as expected, 1 when one did not; with --gate, 1 also when the gate
    failed (gate_passed False: the policy's decision, or no GPU)."""
    if gate_passed is False:
        return gate_decision(False)
    return Exit.OK if as_expected else Exit.BUG


def run(verdict: str) -> Exit:
    """`run`: its case's verdict: clean 0, skip (no GPU, MPS or FA3 build for it) 4, any other 1."""
    if verdict == SKIP:
        return Exit.NOT_RUN
    return Exit.OK if verdict == CLEAN else Exit.BUG


def source(verdicts: Iterable[str]) -> Exit:
    """The source check's verdicts (repro.vllm_integration.releases.source_check) of one tree (`bisect --status`, a
    `--check source` bisect step) or several (`vllm-check`): 1 when one is bad, 0 when every one is good or has no
    known bad pattern (unverified: not run on a GPU; 0 keeps `git bisect run` working), else 125."""
    seen = list(verdicts)
    if BAD in seen:
        return Exit.BUG
    return Exit.OK if seen and all(v in (GOOD, NO_KNOWN_BAD) for v in seen) else Exit.UNTESTABLE


def gate_step(returncode: int) -> Exit:
    """A `--check gate` bisect step: the gate command's 0 (good) and 1 (bad) through, anything else untestable (git
    bisect reads 2 to 124 as bad: a gate that could not answer has shown nothing)."""
    return Exit(returncode) if returncode in (Exit.OK, Exit.BUG) else Exit.UNTESTABLE


def bisect(first_bad: str | None, only_untestable_left: bool) -> Exit:
    """`bisect`: 0 when git named the first bad commit, 125 when only untestable commits were left, else 1."""
    if first_bad:
        return Exit.OK
    return Exit.UNTESTABLE if only_untestable_left else Exit.BUG


def check(ok: bool) -> Exit:
    """The commands that check one thing (`agree`, `xdist-report`, `records --stale`, the MPS coexistence probe): 0 it
    holds, 1 not."""
    return Exit.OK if ok else Exit.BUG


# command -> {exit code: what it means there}; codes not listed never come from that command.
EXIT_CODES: dict[str, dict[int, str]] = {
    "run": {0: "the case is clean", 1: "any other verdict", 2: "bad input", 4: "no GPU, MPS or FA3 build for it"},
    "matrix": {
        0: "every case as expected (with --gate: the gate passed)",
        1: "a case not as expected, HARNESS BLIND, or --gate failed (always without a GPU)",
        2: "bad input (also what the CPU model cannot predict)",
        4: "--gpu-only without a GPU",
    },
    "gate": {
        0: "PASS",
        1: "AFFECTED",
        2: "bad input",
        3: "HARNESS BLIND (--compare-paths: also when the paths' verdicts differ)",
        4: "CANNOT VOUCH (among its causes: none of the methods asked for applies to a build under test, each named with why), no GPU (--devices all: none found), or no vLLM build that can run here",
    },
    "bisect": {
        0: "found the first bad commit (--status: no known bad pattern in this commit's source)",
        1: "no first bad commit found (--status: this commit is bad)",
        2: "bad input (not a git checkout, unknown revision, no vllm/ at --bad or, with --status, in the checkout; a bisect in progress, changed tracked files, another `repro bisect` on it)",
        125: "only untestable commits were left (--status: this commit is untestable)",
    },
    "vllm-check": {
        0: "no known bad pattern in any source (unverified, never `good`: a source's files are checked against its own "
        "RECORD or tag, never the published release's)",
        1: "a source has a known bad pattern (or its release's GPU record says affected)",
        2: "bad input (also a folder or wheel without vllm/: not a vLLM source)",
        125: "a source is untestable (also a wheel that cannot be read whole)",
    },
    "agree": {0: "every verdict agrees", 1: "a verdict disagrees", 2: "bad input"},
    "xdist-report": {
        0: "every worker on a GPU of its own",
        1: "a worker shared or changed GPUs",
        2: "bad input (also XML that is not JUnit, or one where no case recorded its GPU: nothing to check)",
    },
    "bench": {0: "written", 2: "bad input"},
    "redact": {0: "done", 2: "bad input (also a file it cannot read or write: nothing rewritten)"},
    "records": {
        0: "done (--stale: every README GPU command's last record ran the code it runs now)",
        1: "--stale: a README GPU command has no record, or its last record ran older code",
        2: "bad input (no results/ folder, no such record, a record that cannot be read, here or in git history; "
        "--stale outside a git checkout, or with no README GPU command to check)",
    },
    "doctor": {0: "always (it reports what is missing)"},
    "serve": {0: "started, running, stopped or status shown", 2: "bad input, or the server did not start"},
    "plugin-request": {0: "printed", 2: "bad input (a value the plugin would refuse)"},
    "audit": {
        0: "PASS: FULL captures audited, descriptor checks > 0, nothing stale (the command's own status beside it)",
        1: "AFFECTED: stale or stale-descriptor fields, each descriptor named (also with --command-must-pass: a clean "
        "audit of a command that failed)",
        2: "bad input (also a VLLM_PLUGINS that leaves the auditor out, a REPRO_REQUEST set, a --out not new or empty)",
        4: "CANNOT VOUCH: no FULL capture audited, a hook that did not fire, a descriptor check that could not run, a "
        "process that never reported, the timeout, a speculative method other than --expect-method",
        130: "interrupted (Ctrl-C): the command's process group stopped, the report folder marked INTERRUPTED",
    },
    "pytest --repro-audit": {
        0: "no test stale (pytest's own status otherwise)",
        1: "a test during which a FULL capture was stale (it fails), a stale capture reported after its test, a "
        "process that never reported, or no test judged in the whole session",
    },
    "pytest --gate": {
        0: "the gate passed (else pytest's own status)",
        1: "the gate failed, or a test failed",
        2: "bad input: --gate-require naming no known feature, a --gate-report that is a file or cannot be written, a "
        "REPRO_GATE_* or REPRO_SELF_CONTROL variable it cannot read (named)",
        4: "pytest's own usage error (an option it does not know, `--gate=yes`): pytest's code, not 'could not run here'",
        130: "interrupted (Ctrl-C; pytest's own code for it, 2, would read as bad input)",
    },
    "repro.run.smcontrol --probe-coexistence": {
        0: "MPS clients and plain processes coexist",
        1: "they do not",
        2: "bad input",
        4: "no GPU or MPS to probe",
    },
    "repro.vllm_integration.releases.bisect step": {
        0: "good",
        1: "bad",
        125: "untestable",
        128: "bad input (a flag, a folder that is not there): the same at every commit, so git bisect run stops",
    },
}


def markdown() -> str:
    """The codes and every command's table, as docs/exit-codes.md shows them."""
    lines = ["| code | meaning |", "|---|---|"]
    lines += [f"| {int(code)} | {MEANING[code]} |" for code in Exit]
    lines += ["", "| command | code | meaning |", "|---|---|---|"]
    lines += [f"| `{cmd}` | {code} | {what} |" for cmd, codes in EXIT_CODES.items() for code, what in codes.items()]
    return "\n".join(lines)
