"""`python -m repro <subcommand>`: a thin entry; each subcommand lives in its own module of this package (run,
matrix, gate/bisect/vllm-check in vllm, doctor/agree/bench/xdist-report/redact/records in reports, serve; shared pieces in common).
Bad input: one line on stderr and exit code 2, no traceback."""

from __future__ import annotations

import argparse
import os
import sys

from repro import __version__
from repro.cli import matrix, reports, run, serve, vllm
from repro.cli.common import Parser
from repro.errors import ConfigError
from repro.exit_codes import Exit


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m repro",
        description="Stale FA3 attention-metadata reproducer and regression harness. Exit codes: 0 clean or as "
        "expected, 1 the bug is visible (or an expectation failed), 2 bad input, 4 could not run here; gate: 3 "
        "HARNESS BLIND; bisect, vllm-check: 125 untestable (docs/exit-codes.md).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    for module in (reports, run, matrix, serve, vllm):
        module.add_parsers(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        return a.func(a)
    except ConfigError as e:
        sys.stderr.write(f"repro: error: {e}\n")
        return Exit.BAD_INPUT
    except KeyboardInterrupt:
        sys.stderr.write("repro: interrupted\n")
        return Exit.INTERRUPTED
    except BrokenPipeError:  # output piped into head & co.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return Exit.OK
