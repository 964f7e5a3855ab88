"""`repro audit -- COMMAND`'s run: the command started in a session of its own with the auditor asked for in every
vLLM process it starts (REPRO_AUDIT=1, the audit file and start marks in this run's private folder, a fresh run token,
strict on request), bounded by a timeout (its whole process group stopped: SIGTERM, then SIGKILL after a grace),
stopped the same way on Ctrl-C; then what the processes left there read back as typed records (judge.judge reads them).

vLLM loads the plugin through its `vllm.general_plugins` entry point in every process unless VLLM_PLUGINS names
others only: such a VLLM_PLUGINS is refused (no process could audit), as is a REPRO_REQUEST in the environment (a
request of the plugin's wins over REPRO_AUDIT, and would send the reports elsewhere)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from repro.contract.request import ENV as REQUEST_ENV
from repro.errors import ConfigError
from repro.run.process import kill_group, stat_fields, undisturbed
from repro.vllm_integration.ci.judge import CommandStatus
from repro.vllm_integration.plugin import BACKEND_ENV, ENV, FILE_ENV, RUN_ENV
from repro.vllm_integration.plugin.counters import STARTED_ENV, STRICT_ENV

PLUGIN_NAME = "repro_freshness_audit"  # the entry point's name (pyproject.toml), what VLLM_PLUGINS must list
PLUGINS_ENV = "VLLM_PLUGINS"
AUDIT_FILE, STARTED = "audit.json", "started"
GRACE_S = 20.0  # after SIGTERM (timeout) or SIGINT (Ctrl-C): time for vLLM to shut down and its processes to report


def refusal(environ: dict[str, str]) -> str | None:
    """Why the auditor could not ride in this environment's vLLM processes (None: it can)."""
    plugins = environ.get(PLUGINS_ENV)
    if plugins is not None and PLUGIN_NAME not in [p.strip() for p in plugins.split(",")]:
        return (
            f"{PLUGINS_ENV}={plugins!r} leaves out the auditor's plugin ({PLUGIN_NAME}): vLLM would load no auditor; "
            f"add it ({PLUGINS_ENV}={plugins + ',' if plugins else ''}{PLUGIN_NAME}) or unset {PLUGINS_ENV}"
        )
    if environ.get(REQUEST_ENV):
        return f"{REQUEST_ENV} is set: a plugin request wins over the auditor this command asks for; unset it"
    return None


def command_env(folder: Path, strict: bool, backend: str | None, environ: dict[str, str]) -> dict[str, str]:
    """The command's environment: the user's, with the auditor asked for and reporting into `folder`."""
    env = dict(environ)
    env[ENV] = "1"
    env[FILE_ENV] = str(folder / AUDIT_FILE)
    env[STARTED_ENV] = str(folder / STARTED)
    env[RUN_ENV] = f"repro-audit-{os.getpid()}-{time.time():.6f}"  # this run's, never one the shell held
    env.pop(STRICT_ENV, None)
    if strict:
        env[STRICT_ENV] = "1"
    if backend:
        env[BACKEND_ENV] = backend
    return env


@dataclass
class Ran:
    status: CommandStatus
    doc: dict | None  # the merged audit file, None when no process wrote one
    started: list[dict]  # each process's start mark
    unreadable: str | None = None  # the audit file exists but is not a report (said, never read as clean)


def _stop(p: subprocess.Popen, sig: int, grace: float) -> None:
    """Signal the command's process group, give it `grace` s to end (vLLM's processes report at their exit), then
    SIGKILL whatever is left of the group."""
    try:
        os.killpg(p.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        pass
    kill_group(p.pid)
    p.wait()


def _group_alive(pgid: int) -> bool:
    """Does a process of the group still run? A zombie does not (an orphan whose reaper is slow, or none in a
    container): read from /proc where there is one, else whether the group can still be signalled."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for pid in proc.glob("[0-9]*"):
        fields = stat_fields(pid.name)
        if fields and len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def end_leftovers(pgid: int, grace: float) -> bool:
    """After the command exited: what it left running in its session (an engine core still shutting down, a server
    it started) is asked to end (SIGTERM), given `grace` s to write its exit report, then SIGKILLed, so that no
    process is judged while it runs (its snapshot would be read as its whole run). True when something was left."""
    if not _group_alive(pgid):
        return False
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGTERM)
    end = time.monotonic() + grace
    while _group_alive(pgid) and time.monotonic() < end:
        time.sleep(0.1)
    kill_group(pgid)
    return True


def _as_ctrl_c(signum: int, frame: object) -> None:
    """SIGTERM or SIGHUP raised as Ctrl-C's KeyboardInterrupt, naming the signal (the INTERRUPTED mark says which)."""
    raise KeyboardInterrupt(signal.Signals(signum).name)


@contextlib.contextmanager
def ended_as_ctrl_c():
    """SIGTERM (a cancelled CI job) and SIGHUP (a closed terminal or ssh session) raise KeyboardInterrupt as Ctrl-C
    does, so the command that holds this stops its processes and marks its report folder (`repro audit`, `gate`); a
    signal the caller ignores (nohup) stays ignored. Once its body ended by Ctrl-C, both stay ignored: the command is
    ending, and a second one must not kill it before it marks its folder."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    for sig, was in before.items():
        if was is not signal.SIG_IGN:
            signal.signal(sig, _as_ctrl_c)
    ending = False
    try:
        yield
    except KeyboardInterrupt:
        # the command is ending (its processes stopped): a second SIGTERM or hang-up, under the handler restored here
        # (the default: killed at once), would kill it before its report folder is marked INTERRUPTED
        ending = True
        for sig in before:
            signal.signal(sig, signal.SIG_IGN)
        raise
    finally:
        if not ending:
            for sig, was in before.items():
                signal.signal(sig, was)


def run(argv: list[str], folder: Path, timeout: float, strict: bool = False, backend: str | None = None,
        environ: dict[str, str] | None = None, grace: float = GRACE_S) -> Ran:  # fmt: skip
    """Run the command with the auditor under `folder` (made empty by the caller), bounded by `timeout` s."""
    env = command_env(folder, strict, backend, dict(os.environ if environ is None else environ))
    (folder / STARTED).mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    timed_out = False
    # in place before the command starts: no moment where it runs and a signal would leave it behind
    with ended_as_ctrl_c():
        try:
            p = subprocess.Popen(argv, env=env, start_new_session=True)
        except OSError as e:
            raise ConfigError(f"cannot start {argv[0]}: {e.strerror or e}") from None
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            with undisturbed():
                _stop(p, signal.SIGTERM, grace)
        except KeyboardInterrupt:  # the command's group is not the terminal's: stopped here, then the caller's Ctrl-C
            with undisturbed():  # a second Ctrl-C, SIGTERM or hang-up cannot cut the stop short
                _stop(p, signal.SIGINT, grace)
            raise
        else:  # ended by itself: what it left running in its session is stopped before any report is read
            if end_leftovers(p.pid, grace):
                print(f"repro audit: the command left processes running in its session: stopped (SIGTERM, "
                      f"{grace:g} s)", file=sys.stderr)  # fmt: skip
    status = CommandStatus(tuple(argv), None if timed_out else p.returncode, timed_out, time.time() - t0, strict)
    return Ran(status, *read_back(folder))


def read_back(folder: Path) -> tuple[dict | None, list[dict], str | None]:
    """(the merged audit file or None, the start marks, why the audit file could not be read or None)."""
    doc, unreadable = None, None
    path = folder / AUDIT_FILE
    if path.exists():
        try:
            doc = json.loads(path.read_text())
            if not isinstance(doc, dict):
                doc, unreadable = None, f"{path}: not an audit report"
        except (OSError, ValueError) as e:
            unreadable = f"{path}: {e}"
    marks = []
    for mark in sorted((folder / STARTED).glob("*.json")):
        try:
            got = json.loads(mark.read_text())
        except (OSError, ValueError):
            got = {"pid": int(mark.stem) if mark.stem.isdigit() else mark.stem, "process": "(mark unreadable)"}
        if isinstance(got, dict):  # the folder is this run's alone: every mark in it is one of its processes
            marks.append(got)
    return doc, marks, unreadable
