"""The strict gate for pytest (`--gate`, or REPRO_GATE=1): what a CI gate on MIG runners must not let through.

In a gate run a GPU case that skipped fails (a gate that could not run its controls has shown nothing), a positive
control passes only with kernel evidence (a memory fault, a hang, wrong output; the capture audit alone is not
enough), and the session fails with one line when no positive control produced kernel evidence. The plain CPU tier
(no --gate) is unaffected. conftest.py holds the thin hooks; the logic is here."""

from __future__ import annotations

import os

from repro.verdicts import KERNEL_EVIDENCE, no_kernel_evidence

ENV = "REPRO_GATE"
GPU_MARKERS = ("gpu", "vllm")


def enabled(config=None) -> bool:
    if config is not None and config.getoption("gate", default=False):
        return True
    return os.environ.get(ENV) == "1"


def skipped_to_failure(item, report) -> None:
    """A skipped GPU case fails a gate run, with the skip's reason."""
    if not report.skipped or not any(item.get_closest_marker(m) for m in GPU_MARKERS):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"GATE: {item.nodeid} could not run here, so the gate has no evidence from it: {reason}"


class Evidence:
    """Counts positive controls that passed with kernel evidence (from the cases' recorded properties)."""

    def __init__(self) -> None:
        self.controls = 0
        self.with_kernel_evidence = 0

    def add(self, report) -> None:
        if report.when != "call":
            return
        props = dict(report.user_properties)
        if props.get("expected") in ("fault", "detected", "audit") or props.get("role") == "control":
            self.controls += 1
            if props.get("verdict") in KERNEL_EVIDENCE:
                self.with_kernel_evidence += 1

    def failure(self) -> str | None:
        return no_kernel_evidence(self.controls, self.with_kernel_evidence)
