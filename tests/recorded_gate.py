"""Replaying a recorded real-vLLM gate run (results/h200-vllm-*) on a CPU: run_gate with each case process replaced by
what it left in the record (its free-form log, its channel file, its audit file), so classify, annotate, the
attribution rerun, the reference comparison, the coverage check and repro.judge.policy run as they ran on the H200."""

from __future__ import annotations

import argparse
import lzma
import re
import shutil
import time
from dataclasses import replace
from pathlib import Path

from repro.case.spec import STALLED
from repro.contract.channel import UNCOMPARED, Channel, path_for, recorded_before
from repro.judge.classify import classify
from repro.report.records import upgrade_channel, upgrade_gate_row, upgrade_result
from repro.run import own_alloc, smcontrol
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.cache import KEPT_LINE
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.modes import parse_backends, parse_modes
from repro.vllm_integration.gate.process import recorded_attempts
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.plugin.inject import INJECTIONS, STALE_CAPTURE
from tests.records import RESULTS, load


def _whole(out_log: Path) -> bool:
    """A case's output as its process left it (not a kept reference's one-line stand-in, gate_run.keep_in_logs)."""
    return out_log.exists() and not out_log.read_text(errors="replace").startswith(KEPT_LINE)


REFERENCE_WAIT_S = 20.0  # a replayed reference's process takes milliseconds: this is a bound, never a wait


def replay(monkeypatch, tmp_path: Path, record: Path, edit_channel=None, more_logs: tuple[Path, ...] = (), exits=None):
    """(the record's results.json, its rows by case id, the replayed GateRun, every replayed result by case id);
    edit_channel(case_id, text) may change a case's channel records on the way. more_logs: other records' logs
    folders, for a reference the run took from its cache before the gate wrote kept references into its logs.
    exits: case id -> (returncode, timed_out, wall_s), a stand-in for a process's exit its record does not keep."""
    doc = load(record / "results.json")  # parsed once per test session (tests/records.py): read, never changed
    rows = {row["case"]: row for row in doc["cases"]}
    own = record / "logs"
    # every attempt's own process (its exit, clock, timeout) where the record keeps them; None: a row from before
    attempts = {a.case: a for row in rows.values() for a in recorded_attempts(upgrade_gate_row(row)) or ()}
    monkeypatch.setattr(smcontrol, "_sm_count", lambda env: int(doc["environment"]["sms"]))

    def recorded_process(case, cmd, env, log_dir, sanitizer, executor=None, target=None):
        r = rows[case.case_id]["result"]
        out_log = Path(log_dir) / f"{case.case_id}.out.log"
        tried = attempts.get(case.case_id)  # this attempt as its process ended, whatever result its row kept
        # a reference the run kept from its cache left only its RESULT record: the run that stored it has the rest
        logs = next((d for d in (own, *more_logs) if _whole(d / out_log.name)), own)
        out = (logs / out_log.name).read_text(errors="replace")
        out_log.write_text(out)
        records = (logs / path_for(out_log).name).read_text()
        records = upgrade_channel(records)
        if edit_channel is not None:
            records = edit_channel(case.case_id, records)
        path_for(out_log).write_text(records)
        audit = logs / f"{case.case_id}.audit.json"
        if audit.exists():
            shutil.copy(audit, Path(log_dir) / audit.name)
        # a process the gate killed at its timeout, or as stalled (its Stall watch: the flag, in a record from before
        # typed flags its reason's words, through the one upgrader of recorded results)
        killed = r["returncode"] in (-9, 137)
        stalled = STALLED in upgrade_result(r, rows[case.case_id])["flags"]
        timed_out = killed and (r["wall_s"] >= case.timeout_s - 0.5 or stalled)
        returncode, wall_s = r["returncode"], r["wall_s"]
        if tried is not None:  # a record that keeps each attempt: its own exit, as the run classified it
            assert tried.log == out_log.name, (tried, out_log)
            returncode, timed_out, wall_s = tried.returncode, tried.timed_out, tried.wall_s
        if case.case_id in (exits or {}):
            returncode, timed_out, wall_s = exits[case.case_id]
        ch = Channel.read(path_for(out_log))
        memcheck = logs / f"{case.case_id}.memcheck.log"  # compute-sanitizer's own log, where it ran (large: .xz)
        packed = memcheck.with_name(memcheck.name + ".xz")
        san = None
        if sanitizer and memcheck.exists():
            san = memcheck.read_text(errors="replace")
        elif sanitizer and packed.exists():
            san = lzma.decompress(packed.read_bytes()).decode(errors="replace")
        return classify(case, out, returncode, timed_out, san, wall_s, ch), out

    monkeypatch.setattr(gate_process, "run_process", recorded_process)
    # a method or form the build lacked was read from its files on the GPU machine (absent here): as recorded
    recorded_na = {c: row["result"]["not_applicable"] for c, row in rows.items() if row["result"].get("not_applicable")}
    if recorded_na:

        def as_recorded_not_applicable(cases):
            return (
                [c for c in cases if c.case_id not in recorded_na],
                [
                    (c, gate_process.not_applicable_result(c, recorded_na[c.case_id]))
                    for c in cases
                    if c.case_id in recorded_na
                ],
            )

        monkeypatch.setattr(gate_run, "set_apart_not_applicable", as_recorded_not_applicable)
    # memcheck:own's allocator was built on the H200 (nvcc): here its case environment only names it
    monkeypatch.setattr(
        own_alloc, "build", lambda folder=None, guard=False: Path(folder or "own-alloc") / "own_alloc-replayed.so"
    )
    monkeypatch.setattr(gate_run, "MpsDaemon", StandInMps)  # the MPS cases ran under the H200's daemon
    # a self control's further attempts as the recorded run made them (one, in a record from before they existed):
    # every attempt's process is replayed from its own logs, none is invented
    made = [(rows[c]["result"].get("spec") or {}).get("attempt", 0) for c in rows]  # results.json keeps each attempt
    monkeypatch.setattr(gate_process, "SELF_CONTROL_ATTEMPTS", 1 + max(made, default=0))
    # a clean attempt is compared with its reference once that has finished (run_control's `reference`), which on the
    # H200 depended on which process ended first: the reference is seen by the attempts after those the run made
    further = {}
    for c in rows:
        if k := (spec := rows[c]["result"].get("spec") or {}).get("attempt", 0):
            base = replace(GateCase.from_dict(spec), attempt=0).case_id  # the case whose attempt it was
            further[base] = max(further.get(base, 0), k)
    recorded_control = gate_process.run_control

    def run_control_as_recorded(case, builds, log_dir, *where, reference=lambda: None, **how):
        how.pop("caught_beside", None)  # the record's attempts as they ran (a replay's processes end in any order)
        asked, n = [], further.get(case.case_id, 0)
        how["attempts"] = 1 + n  # the attempts the run made, never more (it stopped where another form had caught)

        def as_then():
            asked.append(1)
            if len(asked) <= n:
                return None
            # the run saw its reference here: in the replay, where every process ends at once, wait until it has
            # (bounded: a reference queued behind the waiting cases is not waited for), never judge without it by chance
            end = time.time() + REFERENCE_WAIT_S
            while (got := reference()) is None and time.time() < end:
                time.sleep(0.01)
            return got

        return recorded_control(case, builds, log_dir, *where, reference=as_then, **how)

    monkeypatch.setattr(gate_run, "run_control", run_control_as_recorded)
    builds = {}
    for row in doc["cases"]:
        b = GateCase.from_dict(row["result"]["spec"]).build
        builds.setdefault(b.label, b)
    command = doc["environment"]["command"]
    modes = parse_modes(m[1] if (m := re.search(r"--modes (\S+)", command)) else _gate_default("modes"))
    backends = parse_backends(m[1]) if (m := re.search(r"--backends (\S+)", command)) else ("FLASH_ATTN",)
    # the self controls as the command planned them (a record from before they existed has none)
    if m := re.search(r"--self-control (\S+)", command):
        self_control = m[1]
    else:
        self_control = "under-test" if any("-self-control-" in c for c in rows) else "none"
    run = run_gate(
        list(builds.values()),
        modes,
        tmp_path / "logs",
        jobs=4,  # as the gate's default: which cases run beside which decides, e.g., a platform check's memo
        timeout_s=float(m[1]) if (m := re.search(r"--timeout (\S+)", command)) else _gate_default("timeout"),
        backends=backends,
        self_control=self_control,
        launcher="spawn",  # the processes are replayed: no forkserver to start
        compile=m[1] if (m := re.search(r"--compile (\S+)", command)) else "inductor",
        methods=tuple(m[1].split(",")) if (m := re.search(r"--methods (\S+)", command)) else _default_methods(rows),
        # the self control's forms the run made (a record from before the second form has the first alone)
        self_control_forms=tuple(m[1].split(","))
        if (m := re.search(r"--self-control-forms (\S+)", command))
        else INJECTIONS
        if any("-stale-descriptor-" in c for c in rows)
        else (STALE_CAPTURE,),
        # a self control's plain crash was rerun beside it to name its kernel in records from before it was asked for
        control_kernels="--name-control-kernels" in command
        or any("-self-control" in c and c.endswith("-launch-blocking") for c in rows),
    )
    got = {c.case_id: r for pairs in (run.cases, run.references, run.attributions) for c, r in pairs}
    return doc, rows, run, got


class StandInMps:
    """Stands in for an MPS daemon (the recorded run's, whose cases' processes are replayed; a test's): nothing
    starts."""

    def start(self):
        return self

    def stop(self):
        pass

    def wait_ready(self):
        return 0.0, []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def client_env(self, sms: int, total: int) -> dict[str, str]:
        return {}


def _gate_default(option: str):
    """What `repro gate` takes for an option the recorded command left out (its parser's default)."""
    from repro.cli import build_parser  # the command line's one definition of its defaults

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["gate"].get_default(option)


def _default_methods(rows) -> tuple[str, ...]:
    """The methods a record's command without `--methods` ran: EAGLE alone before every method was the default (its
    case ids name no method), else the default's."""
    from repro.vllm_integration.gate.methods import METHODS, parse_methods

    named = any(f"-{m.replace('_', '-')}-" in c for c in rows for m in METHODS if m != "eagle")
    return parse_methods(_gate_default("methods")) if named else ("eagle",)


FAULTS = ("crash", "hang", "oob")  # kernel evidence a replayed self control shows


def replayed(monkeypatch, tmp_path, record: str):
    """replay() of results/RECORD, with its verdicts checked equal to the recorded ones (a self control's further
    attempts are kept in its row)."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / record)
    assert {k: r.verdict for k, r in got.items()} == {k: rows[k]["verdict"] for k in got}
    assert all("-attempt" in k for k in set(rows) - set(got))  # a self control's further attempts: kept in its row
    return doc, rows, run, got


def same_verdicts(got, rows, run=None):
    """The replayed verdicts are the recorded ones, a self control's further attempts (run.attempts) included, and
    each case's attempts (run.attempted) the ones its row keeps, in order (a row from before they were kept: none)."""
    if run is not None:
        got = {**got, **{c.case_id: r for c, r in run.attempts}}
        for k, row in rows.items():
            if (kept := recorded_attempts(upgrade_gate_row(row))) is not None:
                assert [(a.case, a.verdict) for a in run.attempted.get(k, [])] == [(a.case, a.verdict) for a in kept], k
    replayed = {k: replayed_verdict(r, rows.get(k)) for k, r in got.items()}
    assert replayed == {k: row["verdict"] for k, row in rows.items()}


def replayed_verdict(res, row: dict | None) -> str:
    """The replay's verdict to hold a row's recorded one to: its verdict, or for a row the one upgrader marks
    UNCOMPARED (a further attempt recorded as its process ended, before further attempts were compared with their
    reference) the verdict its replayed process gave, before any later step revised it (CaseResult.first_verdict)."""
    if row is not None and UNCOMPARED in recorded_before(upgrade_gate_row(row)):
        return res.first_verdict
    return res.verdict
