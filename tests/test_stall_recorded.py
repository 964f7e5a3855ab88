"""The capture-stall rule (gate_case.CAPTURE_STALL) against every log the H200 left in results/: no case of a build
under test was ever silent that long after vLLM began capturing CUDA graphs (a false hang would be a false alarm),
while 0.25.1's slow stale draft prefill captures were. The gaps are read between timestamped log lines, an upper bound
on the silence between them (progress bars print in between)."""

from __future__ import annotations

import datetime
import json
import re
from pathlib import Path

from repro.vllm_integration.gate.case import CAPTURE_STALL
from tests.records import RESULTS

STAMP = re.compile(r"(?:INFO|WARNING|DEBUG) (\d\d-\d\d \d\d:\d\d:\d\d)")


def _longest_gap(log: Path) -> float | None:
    text = log.read_text(errors="replace")
    start = text.find(CAPTURE_STALL.marker)
    if start < 0:
        return None
    times = [datetime.datetime.strptime(m[1], "%m-%d %H:%M:%S") for m in STAMP.finditer(text, start)]
    return max(((b - a).total_seconds() for a, b in zip(times, times[1:])), default=None)


def _found_bad(record: Path) -> set[str]:
    """The builds under test a record's own run found affected (its release range's GPU answers): their stale
    captures are slow by the defect itself, as 0.25.1's are."""
    doc = json.loads((record / "results.json").read_text()) if (record / "results.json").exists() else {}
    return {r["build"] for r in (doc.get("release_range") or {}).get("releases", []) if r.get("gpu") == "bad"}


def test_no_recorded_case_of_a_build_under_test_was_silent_for_the_stall_time():
    bad = {record: _found_bad(record) for record in RESULTS.iterdir() if record.is_dir()}
    gaps = {
        log: g
        for log in RESULTS.glob("*/logs/*-under-test-*.out.log")
        if "-reference" not in log.name
        and "-self-control-" not in log.name
        and not any(f"-vllm-{b}-under-test-" in log.name for b in bad[log.parent.parent])
        and (g := _longest_gap(log)) is not None
    }
    assert len(gaps) >= 70
    assert max(gaps.values()) < CAPTURE_STALL.quiet_s / 1.5, max(gaps.items(), key=lambda kv: kv[1])


def test_the_stale_draft_prefill_captures_of_0210_alone_slowed_down():
    # results/h200-eagle-0.20.2-0.21.0-alone: 0.21.0 under test, found affected in the same run; its draft prefill FULL
    # captures (on the target's metadata) went from 46 of 49 at 11 s to 48 of 49 at 30 s, the slowdown that became a
    # stall under contention (h200-eagle-0.20.2-0.21.0), while 0.20.2's the same captures took under a second
    record = RESULTS / "h200-eagle-0.20.2-0.21.0-alone"
    assert _found_bad(record) == {"0.21.0"}
    log = record / "logs" / "stale_metadata-vllm-0.21.0-under-test-plain.out.log"
    assert _longest_gap(log) >= CAPTURE_STALL.quiet_s / 1.5
    bars = re.findall(
        r"eagle prefill CUDA graphs \(FULL\):.*?\| (\d+)/49 \[(\d\d):(\d\d)", log.read_text(errors="replace")
    )
    assert max(int(m) * 60 + int(s) for _, m, s in bars) >= 25
    good = record / "logs" / "stale_metadata-vllm-0.20.2-under-test-plain.out.log"
    assert _longest_gap(good) < CAPTURE_STALL.quiet_s / 1.5


def test_the_stale_draft_prefill_captures_of_0251_were_silent_longer():
    for record, case, more_than in (
        ("h200-sweep-smmargin", "0.25.1-control-smmargin66", 140),
        ("h200-sweep-mps-a", "0.25.1-control-mps8", 60),  # (at mps:16 the last bar came 34 s after the one before)
    ):
        log = RESULTS / record / "logs" / f"stale_metadata-vllm-{case}.out.log"
        bars = re.findall(
            r"Capturing prefill CUDA graphs \(FULL\):.*?\| (\d+)/49 \[(\d\d):(\d\d)", log.read_text(errors="replace")
        )
        elapsed = [(int(n), int(m) * 60 + int(s)) for n, m, s in bars]
        steps = [t1 - t0 for (_, t0), (_, t1) in zip(elapsed, elapsed[1:])]
        assert max(steps) > more_than > CAPTURE_STALL.quiet_s, (record, case, elapsed)
