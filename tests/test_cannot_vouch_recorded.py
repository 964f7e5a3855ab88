"""Where the gate cannot vouch, it says why, judged again on a CPU from the H200 records: a case that ran out of GPU
memory says so; memcheck with poisoned or guarded entries names no access of 0.25.1's own fault; initcheck over
memcheck:own's allocator without its fill ran out of time inside torch's own copies."""

from __future__ import annotations

import lzma

import pytest

from repro.judge.classify import OUT_OF_MEMORY
from tests.recorded_gate import replay, replayed, same_verdicts
from tests.records import RESULTS

V = "stale_metadata-vllm-"


@pytest.mark.parametrize(
    "record, case",
    [
        ("h200-eagle-0.20.2-0.21.0", "0.20.2-under-test-plain"),  # torch's allocator
        ("h200-readme-gate-6", "0.26.0-under-test-plain"),
        ("h200-memcheck-own-guard", "0.26.0-under-test-compile-none-memcheck-own"),  # memcheck's log of cudaMalloc
    ],
)
def test_a_case_that_ran_out_of_gpu_memory_says_so(monkeypatch, tmp_path, record, case):
    got = replayed(monkeypatch, tmp_path, record)[3]
    r = got[V + case]
    assert r.verdict == "error" and r.reason.startswith(OUT_OF_MEMORY) and "out of memory" in r.reason


def test_memcheck_with_poisoned_or_guarded_entries_names_no_access_of_0251s_own_fault(monkeypatch, tmp_path):
    """memcheck:own's first goal, two more routes: int-max in the entries FA3 never writes makes 0.25.1 hang under memcheck
    (no finding in 240 s), splits-33 leaves it clean; guards as large as each tensor: a hang, no finding. The self
    control is an out-of-bounds read in FA3's main kernel under every one of them."""
    got = replayed(monkeypatch, tmp_path / "p", "h200-memcheck-own-poison")[3]
    mode = "compile-none-memcheck-own-poison-"
    assert (
        got[f"{V}0.25.1-control-{mode}int-max"].verdict == "hang"
        and not got[f"{V}0.25.1-control-{mode}int-max"].findings
    )
    assert got[f"{V}0.25.1-control-{mode}splits-33"].verdict == "clean"
    guard = replayed(monkeypatch, tmp_path / "g", "h200-memcheck-own-guard")[3]
    assert guard[f"{V}0.25.1-control-compile-none-memcheck-own"].verdict == "hang"
    for g, m in ((got, f"{mode}int-max"), (got, f"{mode}splits-33"), (guard, "compile-none-memcheck-own")):
        caught = g[f"{V}0.26.0-self-control-{m}"]
        assert caught.verdict == "oob" and caught.kernel == "main" and "allocation" in caught.reason


def test_initcheck_on_memcheck_owns_allocator_cannot_vouch(monkeypatch, tmp_path):
    record = RESULTS / "h200-initcheck-own-nofill"
    doc, rows, run, got = replay(monkeypatch, tmp_path, record)
    same_verdicts(got, rows)
    assert run.outcome() == doc["outcome"] == "CANNOT VOUCH"
    for case in ("0.26.0-under-test", "0.25.1-control"):
        res = got[f"{V}{case}-compile-none-memcheck-own"]
        # the allocator installed itself, then the process ran out of its time before vLLM loaded any plugin: the
        # error says so (the recorded reason, written before, blamed the plugin's install)
        assert res.verdict == "error" and res.reason.startswith("the process was stopped before vLLM loaded"), res
        log = lzma.decompress((record / "logs" / f"{V}{case}-compile-none-memcheck-own.memcheck.log.xz").read_bytes())
        text = log.decode(errors="replace")
        # every finding it printed is torch copying memory nobody wrote, none is in an FA3 kernel
        assert text.count("Uninitialized access") == text.count("on access by cudaMemcpy source") == 200
