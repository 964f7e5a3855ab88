"""Dynamic K and sleep-and-wake judged again on a CPU from the H100 records (vLLM 0.34.0, torch 2.14): the gate's
scenario methods ask vLLM for their base method, so the method check compares vLLM's records with that base
(methods.vllm_method). On the code those records ran, every case was CANNOT VOUCH ("speculative method asked for:
eagle_dynamic_k; vLLM's speculative config ran: eagle"); replayed now, the clean release is clean in every scenario,
the K-specialized self control (stale-k) is caught by the auditor, and the dynamic-K source mutant
(`dynamic-k-one-build-per-shape`, scripts/mutate_vllm.py) is caught in audit. The records' stale-refresh controls are
not replayed (the replay makes the gate's default forms and each method's own, as tests/recorded_gate.py plans them)."""

from __future__ import annotations

from repro.vllm_integration.gate.outcome import GateOutcome
from tests.recorded_gate import replay
from tests.records import RESULTS

V = "stale_metadata-vllm-0.34.0-"
SCENARIOS = ("eagle-dynamic-k", "draft-model-dynamic-k", "eagle-sleep2", "dflash-sleep1")


def test_the_clean_release_is_clean_in_every_dynamic_k_and_sleep_scenario_on_the_h100(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h100-dynamic-sleep-0.34.0")
    assert doc["outcome"] == "CANNOT VOUCH"  # as it ran: the method check compared vLLM's method with the gate's name
    for s in SCENARIOS:
        for mode in ("audit", "plain"):
            r = got[f"{V}under-test-{s}-{mode}"]
            assert r.verdict == "clean", (s, mode, r.reason)
            assert rows[f"{V}under-test-{s}-{mode}"]["verdict"] == "cannot-vouch"


def test_the_k_specialized_self_control_is_caught_by_the_auditor_on_the_h100(monkeypatch, tmp_path):
    got = replay(monkeypatch, tmp_path, RESULTS / "h100-dynamic-sleep-0.34.0")[3]
    for s in ("eagle-dynamic-k", "draft-model-dynamic-k"):
        r = got[f"{V}self-control-stale-k-{s}-audit"]
        assert r.verdict == "stale-audit" and " k2" in r.reason and "num_spec" in r.reason, r.reason
    # the stale-capture and stale-descriptor forms of every scenario: evidence from vLLM in at least one mode
    for s in SCENARIOS:
        for form in ("", "stale-descriptor-"):
            seen = {got[f"{V}self-control-{form}{s}-{m}"].verdict for m in ("audit", "plain")}
            assert seen & {"crash", "wrong-output", "stale-audit"}, (s, form, seen)


def test_the_dynamic_k_source_mutant_is_caught_in_audit_and_plain_mode_says_it_saw_nothing(monkeypatch, tmp_path):
    """The mutant keeps the kernels in bounds: plain mode sees nothing, and with the mutant as the run's only control
    (--self-control none) plain has no evidence of its own: HARNESS BLIND names it (--modes audit asks audit alone)."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h100-dynamic-k-mutant-0.34.0")
    for method in ("eagle-dynamic-k", "mtp-dynamic-k"):
        r = got[f"{V}dk-control-{method}-audit"]
        assert r.verdict == "stale-audit" and "k2" in r.reason, r.reason
        assert got[f"{V}under-test-{method}-audit"].verdict == "clean"
        assert got[f"{V}dk-control-{method}-plain"].verdict == "clean"
    assert doc["outcome"] == "CANNOT VOUCH" and run.outcome() == GateOutcome.BLIND
    assert run.decision().evidence == {"audit": (2, 2), "plain": (2, 0)}
    assert [b.startswith("GATE FAILED: mode plain: none of its 2 positive control(s)") for b in run.blind()] == [True]
