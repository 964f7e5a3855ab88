"""`python -m repro audit [options] -- COMMAND ...`: any command (a script, `pytest` over vLLM's tests, `vllm serve`
with a bounded request driver) run with the freshness auditor in every vLLM process it starts, judged in the gate's
words from every process's report (repro.vllm_integration.ci), its report folder written as docs/outputs.md says."""

from __future__ import annotations

import argparse
import os
import sys

from repro import exit_codes
from repro.cli import outputs
from repro.errors import ConfigError
from repro.judge.decision import GateOutcome
from repro.run.process import MAX_WAIT_S
from repro.vllm_integration.ci import command, report
from repro.vllm_integration.ci.judge import Expect, expected_method, judge
from repro.vllm_integration.plugin.backend_fields import known_name


def add_parsers(sub) -> None:
    what = (
        "run any command with the freshness auditor in every vLLM process it starts and judge it as the gate does: "
        "0 PASS, 1 AFFECTED, 4 CANNOT VOUCH (the command's own status beside it)"
    )
    p = sub.add_parser("audit", help=what, description=what, usage="python -m repro audit [options] -- COMMAND ...")
    p.add_argument("--out", help="report folder, new or empty (default: a new folder under the temp folder)")
    p.add_argument("--overwrite", action="store_true", help=outputs.OVERWRITE_HELP)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds before the command's process group is "
                   "stopped (SIGTERM, then SIGKILL): CANNOT VOUCH (default %(default)s)")  # fmt: skip
    p.add_argument("--grace", type=float, default=command.GRACE_S, help="seconds the command's processes get to end "
                   "and report after SIGTERM (timeout) or SIGINT (Ctrl-C) before SIGKILL (default %(default)s)")  # fmt: skip
    p.add_argument("--strict", action="store_true", help="stop the run at the first stale FULL capture (the engine "
                   "process raises there, its report written first): for bisect speed")  # fmt: skip
    p.add_argument("--expect-method", help="the speculative method the command asks vLLM for (eagle, eagle3, "
                   "draft_model, mtp, dflash, ...): another one run is CANNOT VOUCH, both named")  # fmt: skip
    p.add_argument("--expect-speculator", help="the speculator class expected (e.g. StandaloneARSpeculator)")
    p.add_argument("--expect-manager", help="a capture manager class expected among the FULL captures' managers")
    p.add_argument("--backend", help="vLLM's attention backend the auditor hooks (default: REPRO_ATTENTION_BACKEND, "
                   "else FLASH_ATTN): the one the command's engine uses")  # fmt: skip
    p.add_argument("--junit", help="also a JUnit XML file of the answer (one case per capture manager)")
    p.add_argument("--command-must-pass", action="store_true", help="a clean audit of a command that failed exits 1")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- then the command and its arguments")
    p.set_defaults(func=cmd_audit)


def cmd_audit(a: argparse.Namespace) -> int:
    argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
    if not argv:
        raise ConfigError("no command to audit: give it after --, e.g. python -m repro audit -- python script.py")
    if not (0 < a.timeout <= MAX_WAIT_S and 0 <= a.grace <= MAX_WAIT_S):  # nan and inf too: no bound at all
        raise ConfigError(
            f"--timeout {a.timeout:g}, --grace {a.grace:g}: a timeout over 0 s and a grace of 0 s or more, each a "
            f"number of seconds up to {MAX_WAIT_S:g} (a week)"
        )
    if a.backend is not None and not known_name(a.backend):
        raise ConfigError(f"--backend {a.backend}: not a name vLLM gives a backend (FLASH_ATTN, TRITON_ATTN, ...)")
    why = command.refusal(dict(os.environ))
    if why:
        raise ConfigError(why)
    try:
        method, note = expected_method(a.expect_method)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if note:
        print(f"note: {note}", file=sys.stderr)
    outputs.check_folder(a.out, a.overwrite)
    if a.junit is not None:
        outputs.check_not_the_folders_own(a.junit, "--junit", a.out, ("audit",))
        outputs.check_file(a.junit, "--junit", own=lambda p: outputs.is_text(p) and "<testsuites" in p.read_text())
    folder = outputs.open_folder(a.out, "audit", a.overwrite)
    ran = command.run(argv, folder / "audit", a.timeout, a.strict, a.backend, grace=a.grace)
    j = judge(ran.doc, ran.started, Expect(method, a.expect_speculator, a.expect_manager), ran.status)
    if ran.unreadable:  # an audit file that is not a report: never read as clean
        j.reasons.insert(0, f"the audit file could not be read: {ran.unreadable}")
        if j.outcome == GateOutcome.PASS:
            j.outcome = GateOutcome.CANNOT_VOUCH
    failed = ran.status.returncode != 0
    code = exit_codes.audit(j.outcome, failed, a.command_must_pass)
    report.write(folder, j, ran.status, code, a.junit)
    for line in report.lines(j, ran.status, code):
        print(line, file=sys.stderr)
    print(f"report: {folder}", file=sys.stderr)
    return exit_codes.Exit(code)
