"""The affected range across releases (repro.vllm_integration.releases.release_range) on the build rows the H200 gate runs
recorded (results/h200-vllm*), and its last-good/first-bad logic."""

from __future__ import annotations

import json

from repro.vllm_integration.releases.release_range import (
    BAD,
    GOOD,
    UNSURE,
    markdown,
    releases,
    transitions,
    version_key,
)
from tests.records import RESULTS


def _builds(name: str) -> list[dict]:
    return json.loads((RESULTS / name / "results.json").read_text())["builds"]


def test_recorded_run_gives_fixed_in_0_26_0():
    rows = _builds("h200-vllm-coverage")
    rels = releases(rows)
    assert [(r.build, r.gpu, r.source) for r in rels] == [("0.25.1", BAD, "bad"), ("0.26.0", GOOD, "good")]
    assert transitions(rels) == ["fixed: last bad 0.25.1, first good 0.26.0"]
    assert not any(r.disagrees for r in rels)
    md = "\n".join(markdown(rows))
    assert "DISAGREE" not in md and "| 0.25.1 | 0.25.1 | **bad** |" in md


def test_memcheck_that_could_not_vouch_does_not_hide_a_detection():
    rels = releases(_builds("h200-vllm/gate-memcheck"))
    assert {r.build: r.gpu for r in rels} == {"0.25.1": BAD, "0.26.0": UNSURE}  # 0.26.0: memcheck:async unsure


def test_disagreement_with_the_source_check_is_flagged():
    rows = _builds("h200-vllm-coverage")
    rows[1] = {**rows[1], "source_check": "good"}  # say the source check had read 0.25.1 as good
    rels = releases(rows)
    assert [r.disagrees for r in rels] == [True, False]
    assert any(ln.startswith("- DISAGREEMENT: 0.25.1: the GPU says bad") for ln in markdown(rows))


def test_introduced_and_fixed_with_an_unsure_build_between():
    bad = _builds("h200-vllm-coverage")[1]
    good = _builds("h200-vllm-coverage")[0]
    rows = [
        {**good, "build": "0.22.0", "vllm_version": "0.22.0"},
        {**bad, "build": "0.23.0", "vllm_version": "0.23.0"},
        {**bad, "build": "0.24.0", "vllm_version": "0.24.0", "affected": False, "could_not_vouch": ["plain"]},
        {**bad, "build": "0.25.1", "vllm_version": "0.25.1"},
        {**good, "build": "0.26.0", "vllm_version": "0.26.0"},
    ]
    t = transitions(releases(list(reversed(rows))))  # input order does not matter: versions do
    assert t == ["introduced: last good 0.22.0, first bad 0.23.0", "fixed: last bad 0.25.1, first good 0.26.0"]
    rows[3] = {**rows[3], "affected": False}  # 0.25.1 clean too: the fix lies between 0.23.0 and 0.25.1, past 0.24.0
    assert (
        transitions(releases(rows))[1]
        == "fixed: last bad 0.23.0, first good 0.25.1 (between them, cannot vouch: 0.24.0)"
    )


def test_versions_order_numerically():
    assert sorted(["0.26.0", "0.9.2", "0.25.1", None, "0.10.0"], key=version_key) == [
        "0.9.2", "0.10.0", "0.25.1", "0.26.0", None,
    ]  # fmt: skip


def test_prereleases_and_dev_builds_order_by_pep_440():
    order = ["0.10.2.dev5+gabc", "0.25.1", "0.26.0rc1", "0.26.0", "0.26.0.post1", "not-a-version", None]
    assert sorted(reversed(order), key=version_key) == order
    rows = _builds("h200-vllm-coverage")
    rows = [
        {**rows[0], "build": "0.26.0rc1", "vllm_version": "0.26.0rc1"},
        {**rows[1], "build": "x", "vllm_version": "0.26.0"},
    ]
    assert markdown(rows)  # renders (two versions with different numbers of parts once crashed the report)
