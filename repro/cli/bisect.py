"""`python -m repro bisect`: git bisect a vLLM checkout, the checkout given back as it was (repro.cli.outputs)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from repro import exit_codes
from repro.cli.common import check_exists
from repro.cli.outputs import checkout_kept
from repro.errors import ConfigError
from repro.vllm_integration.releases.bisect import add_check_option, run_bisect  # every parser build reads its option
from repro.vllm_integration.releases.source_check import BAD, GOOD, check_tree

LOG_LINES = 30  # git's bisect log lines shown: the steps, never the first bad commit's diffstat


GOOD_DEFAULT, BAD_DEFAULT = "HEAD~1", "HEAD"


def add_parsers(sub) -> None:
    bi = sub.add_parser("bisect", help="git bisect a vLLM checkout for the stale-metadata capture defect")
    bi.add_argument("--vllm", required=True, help="path of the vLLM git checkout (required)")
    bi.add_argument("--good", help=f"a revision without the defect (default {GOOD_DEFAULT})")
    bi.add_argument("--bad", help=f"a revision with the defect (default {BAD_DEFAULT})")
    add_check_option(bi, "each commit's")
    bi.add_argument(
        "--overlay",
        help="installed vllm package folder: reuse its compiled extensions (Python-only changes) (default: none)",
    )
    bi.add_argument(
        "--status",
        action="store_true",
        help="only check the current commit's source (exit 0 no known bad pattern, 1 bad, 125 untestable)",
    )
    bi.add_argument("gate_cmd", nargs=argparse.REMAINDER, help="-- command for --check gate (default: none)")
    bi.set_defaults(func=cmd_bisect)


def _git(repo: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True)


def steps(log: str, first: str | None) -> list[str]:
    """git's bisect log up to its answer, the line that starts with the first bad commit (in whatever language git
    speaks): that commit is shown with its subject instead of git's diffstat."""
    kept = []
    for line in log.splitlines():
        if first and line.startswith(first):
            break
        kept.append(line)
    return kept[-LOG_LINES:]


def cmd_bisect(a: argparse.Namespace) -> int:
    check_exists(a.vllm)
    if a.status and (
        given := [f for f, v in (("--good", a.good), ("--bad", a.bad), ("--overlay", a.overlay)) if v is not None]
    ):
        raise ConfigError(f"--status reads the checkout as it is: {', '.join(given)} would be ignored; leave it out")
    if a.status and a.check == "gate":
        raise ConfigError("--status reads the current commit's source: --check gate would be ignored; leave it out")
    a.good, a.bad = (GOOD_DEFAULT if a.good is None else a.good), (BAD_DEFAULT if a.bad is None else a.bad)
    if a.overlay is not None and not os.path.isdir(a.overlay):  # every step would exit 2, which git reads as "bad"
        why = "is not a folder" if os.path.exists(a.overlay) else "no such folder"
        raise ConfigError(f"--overlay {a.overlay}: {why} (the installed vllm package folder)")
    if not os.path.isdir(os.path.join(a.vllm, ".git")):
        raise ConfigError(f"{a.vllm}: not a git checkout")
    if a.check == "gate" and not a.gate_cmd:
        raise ConfigError("--check gate needs a gate command after --")
    if a.check != "gate" and [x for x in a.gate_cmd if x != "--"]:  # it would never run
        raise ConfigError(f"a command after -- runs only with --check gate (--check is {a.check})")
    if a.status:  # reads the checkout as it is (inside a bisect of the user's too): moves nothing
        return _bisect(a)
    with checkout_kept(a.vllm):  # refused at once: a bisect in progress, another `repro bisect`, changed files
        return _bisect(a)


def _bisect(a: argparse.Namespace) -> int:
    for flag, rev in () if a.status else (("--good", a.good), ("--bad", a.bad)):  # --status reads neither
        if _git(a.vllm, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode != 0:
            raise ConfigError(f"{flag} {rev}: git knows no such commit in {a.vllm} (git rev-parse --verify failed)")
    if a.status:
        if not os.path.isdir(os.path.join(a.vllm, "vllm")):  # as at --bad below, and vllm-check: bad input
            raise ConfigError(f"{a.vllm}: not a vLLM checkout (no vllm/ package in its working tree)")
        v = check_tree(a.vllm)
        said = "no known bad pattern (not run on a GPU)" if v.verdict == GOOD else v.verdict  # as a bisect step says
        print(f"{said}: {v.reason}" + (f" (layout {v.layout})" if v.layout else ""))
        return exit_codes.source([v.verdict])
    if _git(a.vllm, "cat-file", "-e", f"{a.bad}:vllm").returncode != 0:
        raise ConfigError(f"{a.vllm}: not a vLLM checkout (no vllm/ package at --bad {a.bad})")
    if a.check == "source" and (why := _ends_contradict(a)):  # git takes --good and --bad on trust: its answer
        print(f"bisect found no first bad commit: {why}", file=sys.stderr)  # would name a commit never judged bad
        return exit_codes.bisect(None, False)
    print(f"[bisect] {a.good}..{a.bad} in {a.vllm}, one {a.check} check per commit", flush=True)
    gate_cmd = [x for x in a.gate_cmd if x != "--"] or None
    found = run_bisect(a.vllm, a.good, a.bad, a.check, gate_cmd, a.overlay)  # read from git's refs, never its words
    first, only_untestable = found.first, found.only_skipped
    print("\n".join(steps(found.log, first)))
    if first:
        subject = _git(a.vllm, "log", "-1", "--format=%s", first).stdout.strip()
        print(f"first bad commit: {first} {subject}")
    elif only_untestable:
        print("bisect found no first bad commit: every commit left was untestable (git's log above)", file=sys.stderr)
    else:
        print("bisect found no first bad commit: git's log is printed above", file=sys.stderr)
    return exit_codes.bisect(first, only_untestable)


def _ends_contradict(a: argparse.Namespace) -> str | None:
    """Why the source check contradicts --bad (no known bad pattern there) or --good (the bad pattern already there),
    or None. Each is read from `git archive`, the checkout never moved; --good not an ancestor of --bad is git's to
    refuse (bad input, with its reason)."""
    if _git(a.vllm, "merge-base", "--is-ancestor", a.good, a.bad).returncode != 0:
        return None
    for flag, rev, wrong, said in (
        (("--bad", a.bad, GOOD, "shows no known bad pattern")),
        ("--good", a.good, BAD, "shows the bad pattern already"),
    ):
        with tempfile.TemporaryDirectory(prefix="repro-bisect-") as tmp:
            archive = subprocess.run(["git", "-C", a.vllm, "archive", rev, "vllm"], capture_output=True)
            subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, capture_output=True)
            v = check_tree(tmp)
        if v.verdict == wrong:
            return f"{flag} {rev} {said} in its source ({v.reason}): nothing in this range to bisect"
    return None
