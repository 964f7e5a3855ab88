"""The SM-margin half of the hidden-configuration sweep on the H200 (results/h200-sweep-smmargin: 0.26.0 under test,
0.25.1 as the known-bad control, no self control, the full GPU and sm_margin 8/16/24/40/66, each in audit and
plain), judged again on a CPU from its records with today's policy: 0.26.0 clean in all 12 modes (no false alarm),
0.25.1 caught in 10 of them; the auditor in an SM configuration is the engine's audit, so its stale-audit is those
modes' evidence (the run itself said HARNESS BLIND for the five audit+ modes, before that rule); what stays blind is
where 0.25.1 decoded right and no self control ran."""

from __future__ import annotations

from repro.exit_codes import gate as gate_exit
from repro.judge.decision import MODE_WITHOUT_EVIDENCE
from tests.recorded_gate import replay
from tests.records import RESULTS

RECORD = RESULTS / "h200-sweep-smmargin"
# the full GPU's references came from the cache the README's gate line had written just before, on the same machine
KEPT_FROM = RESULTS / "h200-readme-gate-3" / "logs"
V = "stale_metadata-vllm-"
SMS = (8, 16, 24, 40, 66)


def test_no_false_alarm_and_the_audit_modes_under_sm_margin_are_evidence(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RECORD, more_logs=(KEPT_FROM,))
    assert {k: r.verdict for k, r in got.items()} == {k: row["verdict"] for k, row in rows.items()}
    modes = ["audit", "plain"] + [f"{a}smmargin{n}" for n in SMS for a in ("audit-", "")]
    assert all(got[f"{V}0.26.0-under-test-{m}"].verdict == "clean" for m in modes)  # no false alarm anywhere
    bad = {m: got[f"{V}0.25.1-control-{m}"].verdict for m in modes}
    assert {m for m, v in bad.items() if v == "stale-audit"} == {"audit"} | {f"audit-smmargin{n}" for n in SMS}
    assert {m for m, v in bad.items() if v == "hang"} == {f"smmargin{n}" for n in (8, 16, 24, 40)}
    assert {m for m, v in bad.items() if v == "clean"} == {"plain", "smmargin66"}
    d = run.decision()
    for n in SMS:  # the auditor at sm_margin:N reads vLLM's own objects: its stale views are that mode's evidence
        assert d.evidence[f"audit+sm_margin:{n}"] == (1, 1)
    blind = sorted(f.split("mode ", 1)[1].split(":", 1)[0] for f in d.failures if f.kind == MODE_WITHOUT_EVIDENCE)
    assert blind == ["plain", "sm_margin"]  # plain and sm_margin:66: 0.25.1 silent, no self control asked for
    assert {f.split("mode ", 1)[1].split(": none")[0] for f in d.failures} == {"plain", "sm_margin:66"}
    assert run.outcome() == "HARNESS BLIND" and gate_exit(run.outcome()) == 3
    assert doc["outcome"] == "HARNESS BLIND" and len(doc["blind"]) == 7  # as run: the five audit+ modes too
