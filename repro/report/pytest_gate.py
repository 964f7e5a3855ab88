"""The strict gate for pytest (`--gate`, or REPRO_GATE=1), and how a GPU case is reported to it. The rule is
repro.judge.policy's (the same for `matrix --gate` and `repro gate`); this module turns pytest reports into its Controls.

In a gate run:
- a GPU case that skipped because this machine lacks what it needs (no GPU, no FA3 build) fails: a gate that could
  not run its controls has shown nothing;
- a case whose configuration cannot exist on this runner (MIG on a GPU without MIG, MPS without its control
  daemon, memcheck without compute-sanitizer, a vLLM case with no build named) is NOT APPLICABLE: listed in the
  summary with its reason, and a failure only when the run requires that feature (`--gate-require mig,mps,vllm`,
  REPRO_GATE_REQUIRE; on a MIG runner `mig` is required by default);
- each gating mode needs evidence from its own positive controls (repro.judge.policy.decide).
GatePlugin holds the gate's hooks and its state; conftest.py registers one for a gate run only."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path

import pytest

from repro.errors import Unavailable
from repro.exit_codes import Exit, gate_decision, pytest_session
from repro.files import write_whole
from repro.judge.control import KNOWN_BAD_BUILD, Control
from repro.judge.decision import GATE_WIDE, NOT_COVERED, GateDecision
from repro.judge.excerpt import shorten
from repro.judge.policy import GATE_ENV as ENV
from repro.judge.policy import REQUIRE_ENV, decide, parse_requirements
from repro.report import environment
from repro.report.redact import redact
from repro.report.results import header
from repro.run.pinning import DEVICES_VAR
from repro.run.smcontrol import enumerate_gpus

GPU_MARKERS = ("gpu", "vllm")
NOT_APPLICABLE = "not applicable here: "  # the skip reason's prefix for a configuration this runner cannot have


def enabled(config=None) -> bool:
    if config is not None and config.getoption("gate", default=False):
        return True
    return os.environ.get(ENV) == "1"


def required(config=None, environ=os.environ, discover=enumerate_gpus) -> frozenset[str]:
    """The features this run must cover: --gate-require, else REPRO_GATE_REQUIRE, else `mig` on a MIG runner (MIG
    slices named in REPRO_DEVICES / CUDA_VISIBLE_DEVICES, or found by NVML: the slices conftest pins workers to)."""
    given = config.getoption("gate_require", default=None) if config is not None else None
    text = given if given is not None else environ.get(REQUIRE_ENV)
    if text is not None:
        return parse_requirements(text)
    devices = environ.get(DEVICES_VAR, "") + "," + environ.get("CUDA_VISIBLE_DEVICES", "")
    if devices.strip(","):  # the run names its devices: they alone say whether it is a MIG runner
        return frozenset({"mig"}) if "MIG-" in devices else frozenset()
    try:
        mig = any(g.slices for g in discover())
    except Unavailable:  # no NVML, no driver: not a MIG runner as far as anyone can tell
        mig = False
    return frozenset({"mig"}) if mig else frozenset()


def plain(value):
    """A recorded value as a plain JSON type (str, int, float, bool, None, list, dict with str keys): what xdist's
    serializer (execnet) and the JUnit XML take. A str enum (Verdict, GateOutcome) becomes its value, a dataclass its
    fields, a tuple or set a list, a path its text; anything else its str(). The one place a case's recorded values
    are made plain; the controller makes them typed again in one place too (Control.from_properties)."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, Enum):
        return plain(value.value)
    if isinstance(value, (str, int, float)):  # a subclass (a str enum not an Enum, numpy scalars are not these)
        return (str if isinstance(value, str) else float if isinstance(value, float) else int)(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return plain(dataclasses.asdict(value))
    if isinstance(value, dict):
        return {str(plain(k)): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=str) if isinstance(value, (set, frozenset)) else value
        return [plain(v) for v in items]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return str(value)


def plain_properties(properties) -> list[tuple[str, object]]:
    """A report's user_properties with every value plain (repro.report.pytest_gate.plain)."""
    return [(str(k), plain(v)) for k, v in properties]


def not_applicable(reason: str, needs: str, record_property) -> str:
    """Record that a case cannot exist on this runner; returns the skip reason to raise with."""
    record_property("not_applicable", reason)
    record_property("needs", needs)
    return NOT_APPLICABLE + reason


def no_gpu_line(reason: str) -> str:
    """The one line a gate run stops with where no GPU case can run (no GPU, no Hopper)."""
    return f"GATE FAILED: no GPU case can run here ({reason}), so the gate has no evidence"


def skipped_to_failure(item, report, needed: frozenset[str]) -> None:
    """In a gate run a skipped GPU case fails with the skip's reason, unless it is not applicable here and its feature
    is not required."""
    if not report.skipped or not any(item.get_closest_marker(m) for m in GPU_MARKERS):
        return
    props = dict(report.user_properties)
    if props.get("not_applicable") and props.get("needs") not in needed:
        return
    if (
        getattr(report, "wasxfail", None) is not None
        and props.get("expected") == KNOWN_BAD_BUILD
        and props.get("verdict")
    ):
        return  # a known-bad build silent here ran and recorded its verdict: the session judges it (policy rule 5)
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    why = "required by this run" if props.get("not_applicable") else "could not run here"
    report.longrepr = f"GATE: {item.nodeid} {why}, so the gate has no evidence from it: {reason}"


class Evidence:
    """The controls of a gate session, gathered from the cases' recorded properties (one per call report)."""

    def __init__(self, needed: frozenset[str] = frozenset()) -> None:
        self.needed = needed
        self.controls: list[Control] = []
        self.unreported: list[str] = []  # GPU cases that ended without recording a verdict (a skip before the run)

    def add(self, report) -> None:
        if report.failed and report.when not in ("setup", "call", "teardown"):
            self.unreported.append(report.nodeid)  # an xdist worker crashed in this case (when "???")
            return
        if not any(m in getattr(report, "keywords", {}) for m in GPU_MARKERS):
            return  # a CPU test: not a control
        if report.when not in ("setup", "call") or (report.when == "setup" and report.passed):
            return
        props = dict(report.user_properties)
        if "expected" not in props and not props.get("not_applicable"):
            self.unreported.append(report.nodeid)  # skipped (or failed) before its case could run
            return
        self.controls.append(Control.from_properties(report.nodeid, props))

    def decision(self) -> GateDecision:
        return decide(self.controls, self.needed)

    def write_report(self, folder, wall_s: float, args: list[str]) -> None:
        """gate.md and gate.json in `folder`: command (`python -m pytest` and pytest's `args`, as typed), environment,
        the decision, one row per control."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        env = environment.collect()
        env["command"] = shlex.join(["python", "-m", "pytest", *args])  # collect's own is a repro command
        d = self.decision()
        lines, why = self.summary(d)
        outcome = why or "GATE PASSED"
        md = header("pytest GPU tier (--gate)", env) + [f"**{outcome}** in {wall_s:.1f} s", "", *lines, ""]
        md += ["| case | mode | expected | verdict | reason |", "|---|---|---|---|---|"]
        for c in self.controls:
            verdict = "not applicable" if c.not_applicable else c.verdict
            why_row = c.not_applicable or c.reason
            md.append(f"| {c.case_id} | {c.mode} | {c.expected} | **{verdict}** | {shorten(why_row, 200)} |")
        if d.failures:
            md += ["", "Failures:", ""] + [f"- {f}" for f in d.failures]
        write_whole(folder / "gate.md", (redact("\n".join(md)) + "\n").encode())
        doc = {
            "outcome": outcome,
            "passed": why is None,
            "wall_s": round(wall_s, 1),
            "environment": env,
            "required": sorted(self.needed),
            "failures": d.failures,
            "not_applicable": d.not_applicable,
            "evidence_by_mode": {m: {"positive": p, "with_evidence": e} for m, (p, e) in d.evidence.items()},
            "controls": [c.__dict__ for c in self.controls],
            "unreported": self.unreported,
        }
        write_whole(folder / "gate.json", (redact(json.dumps(doc, indent=1, default=str)) + "\n").encode())

    def summary(self, d: GateDecision | None = None) -> tuple[list[str], str | None]:
        """(lines for the terminal summary, the one failure line or None), from `d` when already decided."""
        d = d or self.decision()
        lines = d.summary()
        if self.unreported:
            lines.append(f"  {len(self.unreported)} GPU case(s) could not run here (no verdict): {self.unreported[0]}")
        why = d.failures[-1] if d.failures and d.failures[-1].kind in GATE_WIDE else None
        covered = not any(f.kind == NOT_COVERED for f in d.failures)  # a required feature's miss says so itself
        if (
            d.failures
            and covered
            and not self.unreported
            and self.controls
            and all(c.not_applicable for c in self.controls)
        ):
            reasons = "; ".join(dict.fromkeys(c.not_applicable for c in self.controls))
            why = f"GATE FAILED: cannot vouch: no case applies here, so nothing was checked ({shorten(reasons, 300)})"
        if why is None and d.failures:
            why = f"GATE FAILED: {len(d.failures)} control(s) failed, first: {d.failures[0]}"
        if why is None and self.unreported:
            why = f"GATE FAILED: {len(self.unreported)} GPU case(s) could not run here"
        return lines, why


PLUGIN_NAME = "repro-gate"  # its name in pytest's plugin manager (config.pluginmanager.get_plugin)


class GatePlugin:
    """The strict gate of one pytest session: its state (the features it requires, the controls gathered, when it
    started) and its hooks. conftest.py registers one only for a gate run (`config.pluginmanager.register(plugin,
    PLUGIN_NAME)`, as pytest-xdist registers its session), in the controller and in every xdist worker: a worker
    turns its skipped GPU cases into failures, the controller gathers every report, says the decision and writes
    the report. `no_gpu` says why no GPU case can run here (None when one can)."""

    def __init__(self, needed: frozenset[str], no_gpu: Callable[[], str | None], started: float | None = None):
        self.needed = needed
        self.no_gpu = no_gpu
        self.started = time.time() if started is None else started
        self.evidence = Evidence(needed)

    @classmethod
    def register(cls, config, no_gpu: Callable[[], str | None], started: float | None = None) -> GatePlugin:
        """A gate run's plugin, registered with `config`; ValueError for a requirement no runner knows. Sets
        REPRO_GATE=1 for the cases (and xdist workers) to read."""
        plugin = cls(required(config), no_gpu, started)
        os.environ[ENV] = "1"
        config.pluginmanager.register(plugin, PLUGIN_NAME)
        return plugin

    @staticmethod
    def _controller(config) -> bool:
        return not hasattr(config, "workerinput")

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session) -> None:
        """Where no GPU case can run, stop with one line (before xdist starts workers), instead of one error block
        per case."""
        if self._controller(session.config) and (why := self.no_gpu()):
            pytest.exit(no_gpu_line(why), returncode=pytest.ExitCode(gate_decision(False)))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_makereport(self, item, call):
        outcome = yield
        skipped_to_failure(item, outcome.get_result(), self.needed)

    def pytest_runtest_logreport(self, report) -> None:
        self.evidence.add(report)

    def pytest_terminal_summary(self, terminalreporter, exitstatus, config) -> None:
        if not self._controller(config):
            return
        lines, why = self.evidence.summary()
        terminalreporter.section("repro gate")
        for line in lines:
            terminalreporter.line(line)
        if why:
            terminalreporter.line(why, red=True)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus) -> None:
        """The controller decides (an xdist worker's reports reach it): a failed gate fails the session
        (repro.exit_codes.pytest_session), and --gate-report gets gate.md and gate.json."""
        config = session.config
        if not self._controller(config):
            return
        _, why = self.evidence.summary()
        status = pytest_session(session.exitstatus, gate_passed=why is None)  # 130: no ExitCode of pytest's
        session.exitstatus = status if status == Exit.INTERRUPTED else pytest.ExitCode(status)
        if folder := config.getoption("gate_report"):
            self.evidence.write_report(folder, time.time() - self.started, list(config.invocation_params.args))
