"""The auditor in another project's pytest suite (vLLM's spec-decode lanes): `pytest --repro-audit` (the entry point
`pytest11` the harness installs; `-p repro.vllm_integration.ci.pytest_audit` where it is not installed), off unless
asked. Every vLLM process a test starts loads the plugin with the auditor on and reports into that test's own audit
file (REPRO_AUDIT_FILE, set before each test: a process reports into the file of the test that started it, whenever
it exits); an engine in pytest's own process is judged by what its auditor found during the test.

- a test during which a FULL capture was stale fails, naming each descriptor and field (at its teardown when its
  engine reported only then; after it, in the session's summary, when a longer-lived engine reported later);
- a test with no FULL capture audited is "not judged" (listed, its outcome unchanged);
- a method other than the one asked for (`--repro-audit-method M`, or a test's `@pytest.mark.repro_audit_method(M)`)
  fails the test, both named;
- the session summary gives the gate's words: PASS, AFFECTED, or CANNOT VOUCH (no test judged, a process that left
  no report at all, a descriptor check that could not run); anything but PASS fails the session
  (exit_codes.pytest_audit). A process killed before its exit report is judged from its last snapshot, as `repro
  audit` judges it, and listed ("judged from its snapshot"); pytest's own process's snapshots are left out of the
  files it reads (what its engine found is judged in-process).
Under xdist each worker judges its own tests; the controller's summary reads their reports and their late findings."""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
from pathlib import Path

import pytest

from repro.entrypoints import PLUGIN_COUNTERS

OPTION, DIR_ENV = "--repro-audit", "REPRO_AUDIT_PYTEST_DIR"  # the session's folder, passed to xdist's workers
PROP = "repro_audit"  # a report's user_properties key: the test's judgement (JSON), carried by xdist
LATE = "repro_audit_late"  # a worker's findings after its tests (config.workeroutput)
MARK = "repro_audit_method"
NOT_JUDGED = "not judged"
REPLAY_KEYS = ("replays_seen", "replays_judged", "refreshes_judged")  # summed over the session's tests


def pytest_addoption(parser) -> None:
    g = parser.getgroup("repro-audit", "the freshness auditor in every vLLM process a test starts (repro)")
    g.addoption(OPTION, action="store_true", help="audit every vLLM process the tests start: a test during which a "
                "FULL CUDA-graph capture baked in stale attention metadata fails")  # fmt: skip
    g.addoption("--repro-audit-dir", help="the audit's folder, new or empty (default: a new one under the temp folder)")
    g.addoption("--repro-audit-method", help="the speculative method every test asks vLLM for (a test's "
                f"@pytest.mark.{MARK}(M) wins): another one run fails the test, both named")  # fmt: skip


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", f"{MARK}(method): the speculative method this test asks vLLM for")
    if config.getoption(OPTION):
        config.pluginmanager.register(AuditPlugin(config), "repro-audit-plugin")


def _safe(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid)[-120:]


class AuditPlugin:
    def __init__(self, config) -> None:
        from repro.vllm_integration.ci import command  # noqa: PLC0415  the gate's modules only in an audited run

        self.config, self.results, self.late, self.ran = config, {}, [], set()
        self.worker = hasattr(config, "workerinput")
        why = command.refusal(dict(os.environ))
        if why:
            raise pytest.UsageError(f"{OPTION}: {why}")
        from repro.vllm_integration.ci.judge import expected_method  # noqa: PLC0415  as above

        try:  # a typo in the method would fail every test: refused before any runs
            self.method = expected_method(config.getoption("--repro-audit-method"), "--repro-audit-method")[0]
        except ValueError as e:
            raise pytest.UsageError(str(e)) from None
        folder = os.environ.get(DIR_ENV) if self.worker else None
        if folder is None:
            given = config.getoption("--repro-audit-dir")
            if given is not None and not given.strip():
                raise pytest.UsageError("--repro-audit-dir '': give a new or empty folder")
            if given:
                p = Path(given)
                if p.exists() and (not p.is_dir() or any(p.iterdir())):
                    raise pytest.UsageError(f"--repro-audit-dir {given}: give a new or empty folder")
                p.mkdir(parents=True, exist_ok=True)
                folder = str(p.absolute())
            else:
                folder = tempfile.mkdtemp(prefix="repro-audit-")
            os.environ[DIR_ENV] = folder
        self.folder = Path(folder)
        # under `repro audit -- pytest ...`: its audit file, marks folder and run token, where every test's reports
        # are forwarded at the session's end (forward), so that command judges the whole run too
        outer = {k: os.environ.get(k) for k in (command.FILE_ENV, command.STARTED_ENV, command.RUN_ENV)}
        self.outer = outer if outer[command.FILE_ENV] else None
        os.environ.update({command.ENV: "1"})
        self.command, self.baseline, self.session_base = command, None, _in_process()

    def _test_folder(self, nodeid: str) -> Path:
        return self.folder / "tests" / _safe(nodeid)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item) -> None:
        c = self.command
        f = self._test_folder(item.nodeid)
        (f / c.STARTED).mkdir(parents=True, exist_ok=True)
        os.environ.update({c.FILE_ENV: str(f / c.AUDIT_FILE), c.STARTED_ENV: str(f / c.STARTED)})
        os.environ[c.RUN_ENV] = f"pytest-{os.getpid()}-{_safe(item.nodeid)}"
        self.baseline = _in_process()

    def _expect(self, item):
        from repro.vllm_integration.ci.judge import Expect, expected_method  # noqa: PLC0415  as __init__

        mark = item.get_closest_marker(MARK)
        if not (mark and mark.args):
            return Expect(method=self.method)
        try:
            return Expect(method=expected_method(mark.args[0], f"@pytest.mark.{MARK}")[0])
        except ValueError:  # a mark's typo: compared as given, so the test fails naming both methods
            return Expect(method=mark.args[0])

    def _judge(self, item):
        from repro.vllm_integration.ci.judge import judge  # noqa: PLC0415  as __init__

        doc, _marks, _ = self.command.read_back(self._test_folder(item.nodeid))
        doc = _with_in_process(_others(doc), self.baseline, _in_process())
        return judge(doc, [], self._expect(item))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        report = outcome.get_result()
        if call.when not in ("call", "teardown"):
            return
        j = self._judge(item)
        verdict = _verdict(j)
        self.ran.add(item.nodeid)  # judged here: its folder read again at this process's session end
        before = self.results.get(item.nodeid)
        self.results[item.nodeid] = verdict
        if call.when == "teardown":
            report.user_properties.append((PROP, json.dumps(verdict)))
        failing = verdict["status"] in ("stale", "method")
        if failing and report.outcome != "failed" and not (before and before["status"] == verdict["status"]):
            report.outcome = "failed"
            report.longrepr = f"repro audit: {verdict['status']} during {item.nodeid}:\n" + "\n".join(
                f"  {r}" for r in verdict["reasons"]
            )

    def pytest_sessionfinish(self, session) -> None:
        """Reports that arrived after their test (longer-lived engines), and processes that never reported."""
        from repro.vllm_integration.ci.judge import Expect, judge  # noqa: PLC0415  as __init__

        for nodeid in sorted(self.ran):  # the tests this process ran (xdist: each worker its own)
            judged = self.results[nodeid]
            doc, marks, _ = self.command.read_back(self._test_folder(nodeid))
            own = [m for m in marks if m.get("pid") != os.getpid()]  # this process's engine: judged in-process
            j = judge(_others(doc), own, Expect())
            if j.stale_fields > judged.get("stale_fields", 0):
                self.late.append(f"{nodeid}: stale after the test ended: " + "; ".join(j.reasons))
            lost = [r for r in j.reasons if "never reported" in r]
            self.late += [f"{nodeid}: {r}" for r in lost]
        self.forward()
        if self.worker:
            self.config.workeroutput[LATE] = json.dumps(self.late)
            return
        failed = summary(self.results, self.late)["outcome"] != "PASS"
        from repro.exit_codes import pytest_audit  # noqa: PLC0415  as __init__

        session.exitstatus = pytest_audit(int(session.exitstatus), failed)

    def forward(self) -> None:
        """Under `repro audit`: every report of this process's tests, its own engine's findings over the session and
        the start marks, into that command's audit file and marks folder (as the processes' own reports, its run's)."""
        if self.outer is None:
            return
        c, reports = self.command, []
        for nodeid in sorted(self.ran):
            doc, marks, _ = c.read_back(self._test_folder(nodeid))
            reports += _reports(_others(doc), self.outer[c.RUN_ENV])
            for m in marks:
                if m.get("pid") != os.getpid() and self.outer[c.STARTED_ENV]:
                    Path(self.outer[c.STARTED_ENV], f"{m.get('pid')}.json").write_text(json.dumps(m))
        mine = _with_in_process(None, self.session_base, _in_process())
        reports += _reports(mine, self.outer[c.RUN_ENV])
        if reports:
            from repro.vllm_integration.plugin.audit_file import merge_into  # noqa: PLC0415  as __init__

            merge_into(self.outer[c.FILE_ENV], reports)

    def pytest_runtest_logreport(self, report) -> None:
        if self.worker or report.when != "teardown":
            return
        for key, value in report.user_properties:
            if key == PROP:
                self.results[report.nodeid] = json.loads(value)

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        self.late += json.loads(getattr(node, "workeroutput", {}).get(LATE, "[]"))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.worker:
            return
        s = summary(self.results, self.late)
        tr = terminalreporter
        tr.section("repro audit")
        tr.write_line(
            f"repro audit: {s['outcome']}: {s['judged']} test(s) judged, {len(s['stale'])} stale, "
            f"{len(s['not_judged'])} not judged (no FULL capture audited), folder {self.folder}"
        )
        for nodeid, reasons in s["stale"].items():
            tr.write_line(f"  stale: {nodeid}: {'; '.join(reasons)}")
        for line in s["cannot_vouch"]:
            tr.write_line(f"  cannot vouch: {line}")
        for nodeid in s["not_judged"]:
            tr.write_line(f"  {NOT_JUDGED}: {nodeid}")
        for line in s["snapshots"]:
            tr.write_line(f"  judged from its snapshot: {line}")
        seen, replays, refreshes = (s[k] for k in REPLAY_KEYS)
        nothing = " (nothing checked at replay: the answer rests on the capture-time checks)" if not replays else ""
        tr.write_line(f"  replay check: {replays} judged of {seen} replays seen{nothing}; refresh: {refreshes} judged")
        (self.folder / "summary.json").write_text(json.dumps(s, indent=1) + "\n")


def _verdict(j) -> dict:
    """A test's judgement: stale, method (another method ran), cannot vouch, clean or not judged."""
    audited = sum(j.audited_by_manager.values())
    method = [r for r in j.reasons if "speculative method asked for" in r or "class expected" in r]
    if j.stale_fields:
        status = "stale"
    elif method:
        status = "method"
    elif not audited:
        status = NOT_JUDGED
    elif j.outcome.value != "PASS":
        status = "cannot vouch"
    else:
        status = "clean"
    rp, rf = j.replay or {}, j.refresh or {}  # what the replay check and the refresh judging judged in the test
    return {"status": status, "reasons": j.reasons, "stale_fields": j.stale_fields, "audited": audited,
            "descriptor_checks": j.descriptor_checks, "methods": j.methods, "replays_seen": rp.get("seen", 0),
            "replays_judged": rp.get("judged", 0), "refreshes_judged": rf.get("judged", 0),
            "snapshots": j.snapshots}  # fmt: skip


def summary(results: dict[str, dict], late: list[str]) -> dict:
    """The session's answer in the gate's words over every test's judgement and the findings after them."""
    stale = {k: v["reasons"] for k, v in results.items() if v["status"] in ("stale",)}
    cannot = [
        f"{k}: {'; '.join(v['reasons'])}" for k, v in results.items() if v["status"] in ("method", "cannot vouch")
    ]
    cannot += [x for x in late if "stale after" not in x]
    judged = sum(v["status"] in ("clean", "stale") for v in results.values())
    if stale or any("stale after" in x for x in late):
        outcome = "AFFECTED"
    elif cannot or not judged:
        outcome = "CANNOT VOUCH"
    else:
        outcome = "PASS"
    stale.update({x.split(": stale after")[0]: [x.split(": ", 1)[1]] for x in late if "stale after" in x})
    if not judged and not cannot:
        cannot.append("no test had a FULL capture audited: nothing was judged")
    not_judged = [k for k, v in results.items() if v["status"] == NOT_JUDGED]
    checked = {k: sum(int(v.get(k) or 0) for v in results.values()) for k in REPLAY_KEYS}
    snapshots = [f"{k}: {line}" for k, v in results.items() for line in v.get("snapshots") or []]
    return {"outcome": outcome, "judged": judged, "stale": stale, "cannot_vouch": cannot, "not_judged": not_judged,
            "snapshots": snapshots, **checked}  # fmt: skip


def _reports(doc: dict | None, run: str | None) -> list[tuple[dict, list[dict]]]:
    """A merged audit document as (process report, its mismatches) pairs, each process counted as of `run`."""
    out, at = [], 0
    mismatches = (doc or {}).get("mismatches") or []
    for p in (doc or {}).get("processes") or []:
        n = int(p.get("stale") or 0)
        base = {"views": 0, "installed": 0.0, "written": 0.0, "summary": ""}
        out.append(({**base, **p, "run": run}, mismatches[at : at + n]))
        at += n
    return out


def _others(doc: dict | None) -> dict | None:
    """A test's audit file without pytest's own process (with its mismatches): its engine's snapshots land in the
    file of the test during which it installed, and what it found is judged in-process (_with_in_process)."""
    if not doc or not any(p.get("pid") == os.getpid() for p in doc.get("processes") or []):
        return doc
    kept = [(p, ms) for p, ms in _reports(doc, None) if p.get("pid") != os.getpid()]
    return {**doc, "processes": [p for p, _ in kept], "mismatches": [m for _, ms in kept for m in ms]}


def _in_process() -> dict | None:
    """What the auditor in pytest's own process has found so far (an engine run in-process), None if never loaded."""
    counters = sys.modules.get(PLUGIN_COUNTERS)
    if counters is None or "audit" not in counters._installed:
        return None
    snap = counters.snapshot()
    snap["mismatches"] = [m.to_dict() for m in counters.AUDITOR.mismatches]
    snap["descriptor_checks_n"] = counters.AUDITOR.descriptor_checks
    return snap


def _with_in_process(doc: dict | None, then: dict | None, now: dict | None) -> dict | None:
    """The test's audit file with pytest's own process added as one more process: what its auditor found during the
    test (the counters' and mismatches' growth since the test's setup)."""
    if now is None:
        return doc
    d = sys.modules[PLUGIN_COUNTERS].delta(now, then)  # now: the plugin's counters module is loaded
    mismatches = now["mismatches"][len((then or {}).get("mismatches") or []) :]
    if not d.get("checks") and not mismatches:
        return doc
    d.pop("mismatches", None)
    mine = {"pid": os.getpid(), "process": "pytest (in-process engine)", "checks": d.get("checks", 0),
            "descriptor_checks": d.get("descriptor_checks_n", 0), "stale": len(mismatches), "counters": d}  # fmt: skip
    doc = dict(doc or {"processes": [], "mismatches": []})
    doc["processes"] = [*(doc.get("processes") or []), mine]
    doc["mismatches"] = [*(doc.get("mismatches") or []), *mismatches]
    return doc
