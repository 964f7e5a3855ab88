"""The plugin's shared state and what it reports: the counters (COUNTERS, printed at exit as `REPRO_COUNTERS <json>`),
the freshness auditor's one instance (AUDITOR), the features installed in this process (_installed), and the report
the auditor writes at exit (stderr lines and the request's audit_file, one file every process of the run reports to:
report_at_exit, registered by at_exit) and keeps on disk while the process runs (keep_snapshot: the same report,
`final` false, so that a process killed by SIGKILL still leaves what it checked). Every hook module of
repro.vllm_integration reads and bumps these objects through this module (`counters.COUNTERS`, never a copy), so a
test that replaces one here replaces it for all of them."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
from collections.abc import Callable
from typing import Any

from repro.contract.channel import emit
from repro.contract.tags import AUDIT_TAG, COUNTERS_TAG
from repro.vllm_integration.plugin.audit import FreshnessAuditor
from repro.vllm_integration.plugin.audit_file import merge_into
from repro.vllm_integration.plugin.inject import bump as bump_counter

FILE_ENV = "REPRO_AUDIT_FILE"  # the audit file of a person's REPRO_AUDIT=1 run (plugin.from_environment)
# the run an audit file's reports belong to: set by the first process that installs the auditor with a file, inherited
# by the processes it starts (fork and spawn); the gate never passes it on (gate.case.PLUGIN_OWN_VARS)
RUN_ENV = "REPRO_AUDIT_RUN"
# `repro audit --strict`: the first stale FULL capture ends its process (capture.stop_if_strict), its report written
STRICT_ENV = "REPRO_AUDIT_STRICT"
# `repro audit`'s private folder: every process that installs the auditor leaves `<pid>.json` there at once
# (mark_started), so a process that dies before its exit report is named, never missed
STARTED_ENV = "REPRO_AUDIT_STARTED"
AUDITOR = FreshnessAuditor()
_installed: set[str] = set()


def new_counters() -> dict[str, Any]:
    return {
        "captures": {},  # graph kind -> CUDA graph captures seen
        "captures_with_attention": {},  # kind -> captures an attention forward ran in (FULL graphs)
        # per capture manager (capture.manager_of: "<manager class>.<attribute> of <owner class>"): every method's
        # captures where they were recorded
        "captures_by_manager": {},  # manager -> CUDA graph captures it recorded
        "full_captures_by_manager": {},  # manager -> of those, captures an attention forward ran in (FULL graphs)
        "audited_by_manager": {},  # manager -> captures whose metadata the auditor checked at capture end
        "stale_by_manager": {},  # manager -> of those, captures with stale views or another descriptor's metadata
        "injected_by_manager": {},  # manager -> captures whose attention read buffers the self control wrote
        "captures_by_k": {},  # K -> FULL captures of a K-specialized descriptor (dynamic speculative decoding)
        "captures_audited": {},  # kind -> captures whose attention metadata the auditor checked at capture end
        "captures_stale": {},  # kind -> of those, captures with stale views
        "checks": 0,  # auditor checks (eager forwards and capture ends)
        "views_checked": 0,  # views compared over those checks
        "attention_forwards": 0,  # hooked <X>Impl.forward calls, eager and captured, every backend together
        "backends": {},  # attention backend name -> its hooked forwards
        "fa_versions": {},  # FLASH_ATTN only: FA version of the impl ("3", or "unknown") -> forwards
        "fields_unlisted": {},  # backend -> tensor fields its table does not list (checked by the rule)
        "fields_not_checked": {},  # backend -> {field: why} for the tensors a metadata object showed and not checked
        "builds_in_graph": 0,  # builds that returned inside a capture (not recorded: no host copy during capture)
        "draft_refreshes": 0,  # eager update_draft_decode_metadata calls that became their metadata's reference
        "draft_refreshes_in_graph": 0,  # ... called inside a capture (the refreshed fields are the graph's)
        "captures_refreshed_in_graph": {},  # kind -> captures whose metadata was refreshed inside them
        # the refresh judged (refresh.judge): after each eager refresh, at the end of each capture refreshed inside it
        "refresh_checks": 0,  # fields a refresh computed, compared with what the builder gives for the step
        "refresh_input_checks": 0,  # what a refresh handed its computing call: eager by value, in a capture by tensor
        "refresh_stale": 0,  # judgings that found a field computed for another step or batch (stale-refresh)
        "refresh_judging": None,  # "on", or why not (the request's judge_refresh false)
        "refresh_unjudged": {},  # "backend.field" -> refreshed fields not judged (no rule, no layout, judging off)
        "refresh_entries_unjudged": {},  # "backend.field" -> entries past the refreshed batch, never compared
        # the descriptor check (audit.descriptor_mismatches) at every FULL capture pass, warmup forwards and capture ends
        "descriptor_checks": {},  # kind -> metadata compared with the descriptor being captured
        "descriptor_stale": {},  # kind -> of those, found built for another descriptor (stale-descriptor)
        # the replay check (plugin.replay): "on", or why it is off (torch without the global replay hook, the request)
        "replay_check": None,
        "replay_graphs": 0,  # FULL draft graphs whose replays it watches
        "replays_seen": 0,  # their replays
        "replay_checks": 0,  # of those, sampled and checked
        "replay_check_s": 0.0,  # seconds the checks took (their overhead)
        "replay_unjudged": {},  # why -> sampled replays no build made for the graph judges; field -> views none wrote
        "slept": None,  # a sleep-and-wake scenario (gate.sleep): the level the engine slept at and woke from
        "descriptor_checks_by_k": {},  # K -> of those, in a K-specialized FULL pass (dynamic speculative decoding)
        "descriptor_unchecked": {},  # "kind: why" -> FULL passes whose metadata could not be compared (cannot vouch)
        "spec_layout": None,  # V2 spec-decode layout of the vLLM that loaded the plugin (plugin.spec_layout)
        "spec_layout_known": None,  # is it one of KNOWN_SPEC_LAYOUTS (None: not looked at, the probe is off)
        "sched_calls": 0,  # get_scheduler_metadata calls (fa3 hooks installed)
        "sched_sm_margin": 0,  # ... that received the injected sm_margin
        "fwd_sm_margin": 0,  # torch.ops._vllm_fa3_C.fwd calls that received it
        "poison_calls": 0,  # scheduler-metadata buffers poisoned
        "entries_poisoned": 0,  # entries filled over all of them
        "runner": None,  # module.Class of the model runner seen on a capture's call stack
        "speculative_method": None,  # the method that runner's speculative config resolved to (capture.graph_kind)
        "speculator": None,  # the class of that runner's speculator (its `speculator` or `drafter`)
        "speculative_methods": {},  # method -> captures a runner of that method made (every engine of the process)
        # the self control (the request's inject, repro.vllm_integration.plugin.inject): what it wrote and whether it reached
        "captures_injected": {},  # kind -> captures whose attention forwards read buffers the injection wrote
        "injected_forwards": 0,  # eager draft-capture forwards that ran right after an injection
    }


COUNTERS: dict[str, Any] = new_counters()


def snapshot() -> dict[str, Any]:
    """The counters as they are now (the auditor's check and view counts folded in)."""
    out = copy.deepcopy(COUNTERS)
    out["checks"], out["views_checked"] = AUDITOR.checks, AUDITOR.views
    out["draft_loop_advances"] = AUDITOR.loop_advances
    out["refresh_checks"] = AUDITOR.refresh_checks
    out["installed"] = sorted(_installed)
    return out


def bump(name: str, key: str | None = None, n: int = 1) -> None:
    """Add n to COUNTERS[name], or to its entry `key` for a counter that counts per key (inject.bump)."""
    bump_counter(COUNTERS, name, key, n)


def _done() -> tuple[int, ...]:
    """What this process's plugin has done so far (checks, views, descriptor checks, stale views, forwards)."""
    a = AUDITOR
    return a.checks, a.views, a.descriptor_checks, len(a.mismatches), COUNTERS["attention_forwards"]


class AtExit:
    """A report made once at a process's exit however the process ends (at_exit): `report(base)`, base None, or in a
    fork child what its parent had done by the fork (_done): such a child reports only what it did since, and
    nothing when it did nothing (a pool worker forked from a process that checks never reports its parent's again).
    `snap(base, reason)`, where given: the same report as a snapshot while the process runs (keep_snapshot), never
    once its exit report was made (a snapshot never replaces it)."""

    def __init__(
        self,
        report: Callable[[tuple[int, ...] | None], None],
        snap: Callable[[tuple[int, ...] | None, str], None] | None = None,
        on_fork: Callable[[], None] | None = None,
    ) -> None:
        self.report, self.snap, self.pid, self.base = report, snap, None, None
        self.on_fork = on_fork  # in a fork child, before anything is reported (report_at_exit: where to)

    def _says(self) -> bool:
        return self.base is None or _done() != self.base or _MARKED["pid"] == os.getpid()  # a marked one always says

    def __call__(self) -> None:
        if self.pid == os.getpid():  # atexit and multiprocessing's finalizers both run in some processes: once
            return
        self.pid = os.getpid()
        if self._says():
            self.report(self.base)

    def snapshot(self, reason: str) -> None:
        if self.snap is not None and self.pid != os.getpid() and self._says():
            self.snap(self.base, reason)

    def forked(self) -> None:
        self.pid, self.base = None, _done()
        _AT_FORK["counters"] = snapshot()  # the child reports its own counts: what they grew by since
        if self.on_fork is not None:
            self.on_fork()
        _SNAP.update(at=0.0, progress=None, stale=0, base=len(AUDITOR.mismatches))  # the child's snapshots its own


_AT_FORK: dict[str, Any] = {"counters": None}  # the counters a fork child inherited (AtExit.forked; own_report)


def delta(now: dict, then: dict | None) -> dict:
    """The counters `now` less those `then` (None: nothing before): an integer counter its growth, a counter per key
    the keys that grew (by how much; those that did not are left out: a method the parent ran is not the child's), any
    other value (a list, a word) as it is now."""
    out: dict[str, Any] = {}
    for k, v in now.items():
        was = (then or {}).get(k)
        if isinstance(v, dict):
            grew = {kk: vv - (was or {}).get(kk, 0) for kk, vv in v.items() if isinstance(vv, int)}
            out[k] = {kk: n for kk, n in grew.items() if n} if then is not None else grew
        elif isinstance(v, int) and not isinstance(v, bool):
            out[k] = v - (was or 0)
        else:
            out[k] = v
    return out


def _refinalize(callback: AtExit) -> None:
    """In a multiprocessing child, after it cleared the finalizers it inherited: the report's finalizer again."""
    import multiprocessing.util as mp_util  # noqa: PLC0415  as at_exit

    callback.forked()
    mp_util.Finalize(None, callback, exitpriority=0)


def at_exit(callback: AtExit) -> None:
    """Register a report for this process's exit and its fork children's: atexit (a process that exits as Python
    does) and multiprocessing's finalizers (a child multiprocessing started ends through os._exit, no atexit handler
    runs: vLLM's engine core, forked when vLLM is used as a library, reports through them; its after-fork hook
    registers the finalizer again in a fork child, which inherits the parent's hooks and loads no plugin again)."""
    import atexit  # noqa: PLC0415  the plugin's exit hooks, registered once a feature installed
    import multiprocessing.util as mp_util  # noqa: PLC0415  as above

    atexit.register(callback)
    mp_util.Finalize(None, callback, exitpriority=0)
    mp_util.register_after_fork(callback, _refinalize)
    os.register_at_fork(after_in_child=callback.forked)  # a plain os.fork child too: its parent's work is not its


_REPORTS: list[AtExit] = []  # the exit reports registered in this process (report_now)


def report_now() -> None:
    """Make this process's exit reports now (a strict stop ends it before its exit): each once, as at exit."""
    for callback in _REPORTS:
        callback()


SNAPSHOT_EVERY_S = 2.0  # the rate-limited snapshot's least interval (eager checks, replays, refreshes)
# the last snapshot's time (time.monotonic), what had been done by then (_progress), its count of stale findings
# and `base`, the findings a fork child's parent had made by the fork (AtExit.forked): the child's first is after it
_SNAP: dict[str, Any] = {"at": 0.0, "progress": None, "stale": 0, "base": 0}


def _progress() -> tuple:
    """What the counting paths move: the checks and findings (_done) and the replay and refresh counts."""
    c = COUNTERS
    return (*_done(), c["replays_seen"], c["replay_checks"], c["draft_refreshes"], AUDITOR.refresh_checks)


def keep_snapshot(reason: str, now: bool = False) -> None:
    """This process's report kept on disk while it runs (write_snapshot: `final` false), so that a process killed by
    SIGKILL (vllm serve's shutdown force-kills its engine core) still leaves what it checked: at once where `now`
    or at the process's first stale finding (its verdict is never lost), else at most once every SNAPSHOT_EVERY_S
    and only if the counts moved (later findings: a self control finds something at nearly every capture, and
    each snapshot rewrites the whole audit file). A FULL capture's end asks `now` while nothing was found.
    `reason`: the event, as the report says it (snapshot_reason). Only time and counts are read here: no tensor, no
    host sync; nothing raised reaches vLLM's forward, replay or capture paths (a snapshot missing, never a crash)."""
    with contextlib.suppress(Exception):  # noqa: BLE001
        _keep_snapshot(reason, now)


def _keep_snapshot(reason: str, now: bool) -> None:
    if not any(c.snap is not None for c in _REPORTS):
        return
    base = _SNAP.get("base", 0)
    found = len(AUDITOR.mismatches) > base and _SNAP["stale"] <= base
    t = time.monotonic()
    if not (now or found) and (t - _SNAP["at"] < SNAPSHOT_EVERY_S or _progress() == _SNAP["progress"]):
        return
    _SNAP.update(at=t, progress=_progress(), stale=len(AUDITOR.mismatches))
    for callback in _REPORTS:
        callback.snapshot(f"{reason} (a stale finding)" if found else reason)


_MARKED = {"pid": None}


def mark_started(folder: str | None) -> None:
    """With STARTED_ENV's folder: `<pid>.json` there (pid, process name, run token) as the auditor installs, and in a
    fork child (which inherits the installed plugin) at its first capture (capture's tracker: mark_started again),
    so the command that made the folder can name a process that never reported (killed, or died before its exit)."""
    if not folder or _MARKED["pid"] == os.getpid():
        return
    _MARKED["pid"] = os.getpid()
    import multiprocessing  # noqa: PLC0415  the process's name, only where a folder asks for the mark

    doc = {"pid": os.getpid(), "process": multiprocessing.current_process().name, "run": run_token()}
    with contextlib.suppress(OSError):  # a mark that cannot be written is a missing mark: never a crash inside vLLM
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(doc, f)


def run_token() -> str:
    """This run's token (RUN_ENV): the first process of a run sets it, the processes it starts inherit it."""
    return os.environ.setdefault(RUN_ENV, f"{os.getpid()}-{time.time():.6f}")


def report_at_exit(path: str | None) -> AtExit:
    """What the plugin registers at exit once its auditor installed (at_exit): write_report, with the time it
    installed and, with an audit file, the run's token (which reports in the file belong to this run: merged_report)."""
    installed = time.time()
    to = {"path": path, "run": run_token() if path else None}
    from_env = path is not None and path == os.environ.get(FILE_ENV)

    def follow_environment() -> None:
        """A fork child whose audit file came from FILE_ENV reports where its own environment says, as its start
        mark does (mark_started): pytest --repro-audit moves FILE_ENV and RUN_ENV to each test's folder, and vLLM's
        engine core forked in a later test inherits an auditor installed in pytest's process during an earlier one."""
        if from_env and (now := os.environ.get(FILE_ENV)) and now != to["path"]:
            to.update(path=now, run=run_token())

    callback = AtExit(
        lambda base: write_report(to["path"], installed, to["run"], base),
        (lambda base, reason: write_snapshot(to["path"], installed, to["run"], base, reason)) if path else None,
        follow_environment,
    )
    _REPORTS.append(callback)
    return callback


def write_report(
    path: str | None, installed: float | None = None, run: str | None = None, base: tuple[int, ...] | None = None
) -> None:
    """At exit, with the auditor on: its summary as an AUDIT_TAG line and, when the request names an audit file
    (path), this process's whole report (every mismatch, the counters; `final` true) merged into that file
    (merged_report), replacing its snapshot there: every process vLLM starts loads the plugin and reports at its exit
    (its multi-process engine: the front-end, which checks nothing, and the engine core, which runs the model), so
    none overwrites another's. `base`: what a fork child's parent had done by the fork (AtExit), not counted again."""
    mine, mismatches = own_report(installed, run, base)
    emit(AUDIT_TAG, {k: mine[k] for k in ("summary", "checks", "views", "stale", "descriptor_checks")})
    if path:
        merge_into(path, [({**mine, "final": True}, mismatches)])


def write_snapshot(
    path: str, installed: float | None, run: str | None, base: tuple[int, ...] | None, reason: str
) -> None:
    """The same report while the process runs (keep_snapshot): `final` false, `snapshot_reason` the event after
    which it was written; no AUDIT_TAG line (that one is the exit's). A file that cannot be written is a snapshot
    missing, never a crash inside vLLM (the exit report still tries)."""
    with contextlib.suppress(Exception):  # noqa: BLE001  called from vLLM's forward, replay and capture paths
        mine, mismatches = own_report(installed, run, base)
        merge_into(path, [({**mine, "final": False, "snapshot_reason": reason}, mismatches)])


def own_report(
    installed: float | None, run: str | None, base: tuple[int, ...] | None
) -> tuple[dict[str, Any], list[dict]]:
    """This process's report as it stands (what it did since `base`) and its mismatches as dicts."""
    import multiprocessing  # noqa: PLC0415  the process's name (vLLM names its engine core's)

    b = base or (0, 0, 0, 0, 0)
    mismatches = AUDITOR.mismatches[b[3] :]
    mine = {
        "pid": os.getpid(),
        "process": multiprocessing.current_process().name,
        "run": run_token() if run is None else run,
        "installed": time.time() if installed is None else installed,
        "written": time.time(),
        "checks": AUDITOR.checks - b[0],
        "views": AUDITOR.views - b[1],
        "descriptor_checks": AUDITOR.descriptor_checks - b[2],
        "stale": len(mismatches),
        "summary": AUDITOR.report(),
        "counters": delta(snapshot(), _AT_FORK["counters"]) if base is not None else snapshot(),
    }
    return mine, [m.to_dict() for m in mismatches]


def write_counters(base: tuple[int, ...] | None = None) -> None:
    """At exit, with the probe on: the counters as a COUNTERS_TAG line (registered as AtExit(write_counters))."""
    emit(COUNTERS_TAG, snapshot())
