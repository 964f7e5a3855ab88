"""`python -m repro <subcommand>`: a thin entry; each subcommand lives in its own module of this package (run,
matrix, gate/vllm-check in vllm, bisect, doctor/agree/bench/xdist-report/redact/records in reports, serve,
plugin-request in plugin, audit in audit; shared pieces in common; the rule for what a command writes in outputs).
Bad input: one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import argparse
import os
import sys

from repro import __version__
from repro.cli import audit, bisect, matrix, outputs, plugin, reports, run, serve, vllm
from repro.errors import ConfigError
from repro.exit_codes import Exit, Parser
from repro.run.process import undisturbed


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m repro",
        description="Stale FA3 attention-metadata reproducer and regression harness. Exit codes: 0 clean or as "
        "expected, 1 the bug is visible (or an expectation failed), 2 bad input, 4 could not run here; gate: 3 "
        "HARNESS BLIND; bisect, vllm-check: 125 untestable (docs/exit-codes.md).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for module in (reports, run, matrix, serve, bisect, vllm, plugin, audit):
        module.add_parsers(sub)
    return p


def _no_command(p: argparse.ArgumentParser, argv: list[str]) -> None:
    """An option before any command (`python -m repro --nope`): name the option, not the missing command."""
    sub = next(x for x in p._actions if x.dest == "cmd")
    for arg in argv:
        if arg in sub.choices:
            return
        if arg.startswith("-") and arg not in ("-h", "--help", "--version"):
            p.error(
                f"unknown option {arg.split('=')[0]} before a command; give a command first: "
                f"python -m repro COMMAND [options] (commands: {', '.join(sub.choices)})"
            )


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    _no_command(p, sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    try:
        code = a.func(a)
    except ConfigError as e:
        outputs.abandon("refused")
        sys.stderr.write(f"repro: error: {e}\n")
        return Exit.BAD_INPUT
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP taken as Ctrl-C (ci.command.ended_as_ctrl_c): named
        how = f"{e.args[0]} (taken as Ctrl-C)" if e.args and isinstance(e.args[0], str) else "Ctrl-C"
        with undisturbed():  # a second Ctrl-C must not cut the folder's marking short
            outputs.abandon(f"interrupted with {how}")
        sys.stderr.write("repro: interrupted\n")
        return Exit.INTERRUPTED
    except BrokenPipeError:  # output piped into head & co.
        outputs.finish()
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK
    except BaseException as e:
        outputs.abandon(f"stopped by {type(e).__name__}")
        raise
    outputs.finish()
    return code
