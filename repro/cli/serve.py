"""`python -m repro serve`: start, stop or show the repro server that outlives commands (repro.run.server)."""

from __future__ import annotations

import argparse
import sys
import time

from repro import exit_codes
from repro.cli.common import check_out_dir, gpu_present, seconds
from repro.errors import ConfigError
from repro.run import server


def add_parsers(sub) -> None:
    s = sub.add_parser(
        "serve",
        help="keep torch and the FA3 libraries imported between commands (matrix forks its cases from it)",
        description="Starts the repro server in the background, or says it already runs this code. Commands use it "
        "when its fingerprint (the harness's sources, interpreter, FA3 libraries) equals theirs.",
    )
    what = s.add_mutually_exclusive_group()
    what.add_argument("--stop", action="store_true", help="stop the server")
    what.add_argument("--status", action="store_true", help="say whether one runs, and whether this code")
    s.add_argument(
        "--idle",
        type=seconds,
        default=server.DEFAULT_IDLE_S,
        help="seconds without a request after which it stops (default %(default)g)",
    )
    s.set_defaults(func=cmd_serve)


MIN_IDLE_S = 1.0  # seconds


def cmd_serve(a: argparse.Namespace) -> int:

    path = server.socket_path()
    if path is None:
        raise ConfigError(f"{server.SOCKET_ENV}=off: no server to {'stop' if a.stop else 'use'}")
    if a.idle < MIN_IDLE_S:  # a server that stops before it answers its first request serves nothing
        raise ConfigError(f"--idle must be at least {MIN_IDLE_S:g} s, got {a.idle:g}")
    facts = server.running(path)
    if a.stop:
        stopped = server.stop(path)
        print(f"stopped the repro server (pid {stopped['pid']})" if stopped else f"no repro server at {path}")
        return exit_codes.Exit.OK
    if facts is not None and facts["refused"]:  # it said why and exited: there is none to show or keep
        print(f"the repro server at {path} (pid {facts['pid']}) refused to serve: {facts['refused']}", file=sys.stderr)
        facts = None
    fits = facts is not None and facts["fingerprint"] == server.code_fingerprint()
    busy = " It serves a command now (one at a time: another forks from its own)." if facts and facts["busy"] else ""
    if a.status:
        if facts is None:
            print(f"no repro server at {path}")
        else:
            age = time.time() - facts["started"]
            print(
                f"repro server at {path}: pid {facts['pid']}, up {age:.0f} s, "
                + ("runs this code" if fits else "runs other code than this command: `serve` restarts it")
                + busy
            )
        return exit_codes.Exit.OK
    if fits:
        print(f"the repro server at {path} (pid {facts['pid']}) already runs this code.{busy}")
        return exit_codes.Exit.OK
    if busy:  # restarting it would end another command's running cases
        raise ConfigError(
            f"the repro server at {path} (pid {facts['pid']}) runs other code and serves a command now: "
            "try again once it is done, or `python -m repro serve --stop` (its cases end)"
        )
    server.check_socket_path(path)
    if not path.parent.is_dir() and path.parent != server.user_dir():  # only the default folder is made
        raise ConfigError(
            f"{server.SOCKET_ENV}: the socket's folder {path.parent} does not exist: make it, or choose another path"
        )
    check_out_dir(str(path.parent), f"{server.SOCKET_ENV}: the socket's folder")
    if facts is not None:
        server.stop(path)
    if not gpu_present():
        print(
            "note: no CUDA GPU here: no case runs on this machine, so a server is of no use to it "
            "(matrix predicts with the CPU model, which needs none); starting it anyway",
            file=sys.stderr,
        )
    facts = server.start(path, a.idle)
    print(
        f"repro server at {path}: pid {facts['pid']}, imports took {facts['preload_s']:g} s; "
        f"it stops after {a.idle:g} s idle or with `python -m repro serve --stop`"
    )
    return exit_codes.Exit.OK
