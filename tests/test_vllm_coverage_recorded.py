"""The real-vLLM gate run recorded on the H200 with coverage counters (results/h200-vllm-coverage: gate.txt, the
command's output; verdicts.md; results.json; logs/ with every case process's output and the auditor's JSON), judged
again on a CPU through the gate's own code: repro.vllm_integration.gate.run.run_gate with its case processes replayed
from the recorded logs (the output each one printed, the exit status results.json recorded for it), so classify,
annotate, the launch-blocking attribution, the reference comparison, not_fired/vouch and repro.judge.policy.decide all run
as they ran on the H200. The record files are only read; a replay copies what it needs to a temporary folder.

Then the coverage rule on real data: a clean 0.26.0 case whose engine/counters lines are gone, whose auditor made 0
checks, or whose engine ran another attention backend, becomes cannot-vouch naming what did not fire, and the run
CANNOT VOUCH."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from repro.contract.tags import AUDIT_TAG, COUNTERS_TAG, ENGINE_TAG
from repro.contract.verdicts import CANNOT_VOUCH, CLEAN, CRASH
from repro.exit_codes import gate as gate_exit
from repro.judge.classify import classify
from repro.judge.policy import decide
from repro.report.records import upgrade_channel
from repro.run import smcontrol
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import report as gate_report
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.releases.builds import VllmBuild
from tests.records import RESULTS

RECORD = RESULTS / "h200-vllm-coverage"
LOGS = RECORD / "logs"
DOC = json.loads((RECORD / "results.json").read_text())
ROWS = {row["case"]: row for row in DOC["cases"]}
UNDER_TEST_AUDIT = "stale_metadata-vllm-0.26.0-under-test-audit"
UNDER_TEST_PLAIN = "stale_metadata-vllm-0.26.0-under-test-plain"


def _builds() -> list[VllmBuild]:
    seen: dict[str, VllmBuild] = {}
    for row in DOC["cases"]:
        b = GateCase.from_dict(row["result"]["spec"]).build
        seen.setdefault(b.label, b)
    return list(seen.values())


def _modes() -> str:
    """The --modes of the recorded command (the environment's command line)."""
    return re.search(r"--modes (\S+)", DOC["environment"]["command"])[1]


def replay(monkeypatch, tmp_path: Path, edit=None):
    """run_gate over the recorded builds and modes, each case process replaced by what it left on the H200: its
    output (after edit(case_id, text) when given) and its audit JSON copied into the run's log folder, the recorded
    exit status and wall time. Returns the GateRun."""
    sms = int(DOC["environment"]["sms"])
    monkeypatch.setattr(smcontrol, "_sm_count", lambda env: sms)  # the recorded GPU's SM count (no probe here)

    def recorded_process(case, cmd, env, log_dir, sanitizer, executor=None, target=None):
        r = ROWS[case.case_id]["result"]
        assert GateCase.from_dict(r["spec"]) == case, case.case_id  # the plan rebuilt the recorded case
        out = upgrade_channel((LOGS / f"{case.case_id}.out.log").read_text(errors="replace"))  # records from before
        if edit is not None:
            out = edit(case.case_id, out)
        log_dir = Path(log_dir)
        (log_dir / f"{case.case_id}.out.log").write_text(out)
        audit = LOGS / f"{case.case_id}.audit.json"
        if audit.exists():
            shutil.copy(audit, log_dir / audit.name)
        return classify(case, out, r["returncode"], False, None, r["wall_s"]), out

    monkeypatch.setattr(gate_process, "run_process", recorded_process)
    logs = tmp_path / "logs"  # the processes are replayed: no forkserver to start
    return run_gate(
        _builds(), parse_modes(_modes()), logs, jobs=4, timeout_s=240.0, self_control="none", launcher="spawn"
    )


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        return replay(mp, tmp_path_factory.mktemp("replay"))


def test_the_record_is_whole():
    """Every case, reference and attribution rerun in results.json has its process output in logs/; the audit-mode
    cases have the auditor's JSON; gate.txt ends with the same Gate line as verdicts.md."""
    assert len(DOC["cases"]) == 13 and DOC["outcome"] == "PASS"
    for case_id, row in ROWS.items():
        assert (LOGS / f"{case_id}.out.log").is_file(), case_id
        assert (LOGS / f"{case_id}.audit.json").is_file() == (row["mode"] == "audit"), case_id
    gate_line = next(ln for ln in (RECORD / "verdicts.md").read_text().splitlines() if ln.startswith("**Gate:"))
    assert gate_line in (RECORD / "gate.txt").read_text()


def test_every_recorded_verdict_comes_back_from_the_logs(recorded_run):
    """The same cases, references and attribution rerun, each with the recorded verdict, kernel, descriptor,
    evidence, expectation and stale fields."""
    got = {
        c.case_id: (kind, r)
        for kind, pairs in (("case", recorded_run.cases), ("reference", recorded_run.references))
        for c, r in pairs
    }
    got.update({c.case_id: ("attribution", r) for c, r in recorded_run.attributions})
    assert set(got) == set(ROWS)
    for case_id, row in ROWS.items():
        kind, r = got[case_id]
        rec = row["result"]
        assert kind == row["kind"], case_id
        assert (r.verdict, r.kernel, r.descriptor) == (rec["verdict"], rec["kernel"], rec["descriptor"]), case_id
        assert (r.evidence, r.stale_fields) == (rec["evidence"], rec["stale_fields"]), case_id
        # the reason quotes the faulting line cut to a length, and the record was redacted after (a long build path
        # became <path>): the replay, from the redacted log, quotes at least what was recorded
        assert r.reason.startswith(rec["reason"]) and len(r.reason) - len(rec["reason"]) < 40, case_id
        if kind == "case":
            # recorded before policy rule 5: a known-bad build outside the audit mode was `detected`, in it `audit`;
            # both are `known-bad` now (rule 5 judges the build over its modes and methods)
            known_bad = (
                "-control-" in case_id and "self-control" not in case_id and rec["expected"] in ("detected", "audit")
            )
            assert r.expected == ("known-bad" if known_bad else rec["expected"]), case_id
    verdicts = {c.case_id: r.verdict for c, r in recorded_run.cases}
    assert {v for k, v in verdicts.items() if "0.26.0" in k} == {CLEAN}
    assert {v for k, v in verdicts.items() if "0.25.1" in k} == {CRASH}


def test_the_recorded_outcome_and_decision_come_back(recorded_run):
    """PASS, through repro.judge.policy.decide over the re-derived controls: the summary lines results.json holds, no
    affected build, nothing cannot-vouch, no blind control."""
    assert recorded_run.outcome() == DOC["outcome"] == "PASS" and gate_exit(recorded_run.outcome()) == 0
    d = decide(recorded_run.controls())
    assert d.passed and d.summary() == DOC["decision"]
    assert {m: ev for m, (pos, ev) in d.evidence.items()} == {
        m: 1 for m in ("audit", "plain", "poison:int-max", "sm_margin:16")
    }
    assert recorded_run.affected() == [] == DOC["affected"]
    assert recorded_run.not_vouched() == [] == DOC["cannot_vouch"]
    assert recorded_run.blind() == [] == DOC["blind"]


def _table(md: str, header: str) -> list[str]:
    """The rows of the Markdown table whose header line starts with `header` (up to the blank line after it)."""
    lines = md.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith(header))
    end = next((j for j in range(i, len(lines)) if not lines[j].strip()), len(lines))
    return lines[i + 2 : end]


COVERAGE_HEADER = "| build | configuration seen |"
PER_CASE_HEADER = "| case | configuration |"


def test_the_coverage_tables_come_back_from_the_logs(recorded_run):
    """The per-build coverage table (counters summed over each build's cases) and the per-case table of verdicts.md,
    rendered again from the replayed run, line for line."""
    recorded = (RECORD / "verdicts.md").read_text()
    again = gate_report.markdown(recorded_run, DOC["environment"])
    assert (
        _table(again, PER_CASE_HEADER) == _table(recorded, PER_CASE_HEADER)
        and len(_table(recorded, PER_CASE_HEADER)) >= 2
    )
    rows, was = _table(again, COVERAGE_HEADER), _table(recorded, COVERAGE_HEADER)
    assert len(rows) == len(was) >= 2
    for row, old in zip(
        rows, was
    ):  # the record's columns, then what was judged at replay and refresh, which it predates
        assert row == old + " replay: replay check not reported; refresh: refresh judging not reported |", row


def _last(text: str, tag: str) -> dict:
    """The last `<tag> <json>` line of a recorded log, parsed here (independent of repro.contract.channel)."""
    found = [json.loads(ln[len(tag) + 1 :]) for ln in text.splitlines() if ln.startswith(tag + " {")]
    return found[-1] if found else {}


def test_the_build_counters_equal_sums_counted_from_the_raw_lines(recorded_run):
    """gate_report.coverage per build against sums made here from each case's last REPRO_COUNTERS line (the
    process's exit report), independent of annotate and coverage."""
    by_build = {s["build"]: s["coverage"] for s in gate_report.build_summary(recorded_run)}
    for label in ("0.26.0", "0.25.1"):
        cases = [k for k, row in ROWS.items() if row["kind"] == "case" and row["build"] == label]
        raw = [_last((LOGS / f"{k}.out.log").read_text(errors="replace"), COUNTERS_TAG) for k in cases]
        assert all(raw), label  # every case of both builds printed its counters
        cov = by_build[label]
        assert cov["cases_reporting"] == len(cases) == 4
        for key in ("checks", "views_checked", "attention_forwards", "sched_sm_margin", "fwd_sm_margin"):
            assert cov[key] == sum(c.get(key, 0) for c in raw), (label, key)
        assert cov["entries_poisoned"] == sum(c.get("entries_poisoned", 0) for c in raw)
        for kind in ("captures", "captures_with_attention", "captures_audited", "captures_stale"):
            summed: dict = {}
            for c in raw:
                for k, n in (c.get(kind) or {}).items():
                    summed[k] = summed.get(k, 0) + n
            assert cov[kind] == summed, (label, kind)
    # what the per-build table says, checked against the numbers counted here
    assert by_build["0.26.0"]["checks"] == 360 and by_build["0.25.1"]["checks"] == 236
    assert by_build["0.25.1"]["captures_stale"] == {"draft prefill": 44}


def test_the_audit_mode_checks_come_from_the_auditor_json(recorded_run):
    """The audit evidence ('N stale fields in M checks') against the auditor's own JSON files in logs/."""
    for c, r in recorded_run.cases:
        if c.mode.name != "audit":
            continue
        report = json.loads((LOGS / f"{c.case_id}.audit.json").read_text())
        n_stale = len(report.get("mismatches") or [])
        assert f"audit: {n_stale} stale fields in {report['checks']} checks" in r.evidence, c.case_id
        assert sum(r.stale_fields.values()) == n_stale


# The coverage rule on real data: edits of a recorded clean 0.26.0 case's output (in the replay's copy).


def _drop_tags(*tags: str):
    def edit(case_id: str, text: str) -> str:
        if case_id != UNDER_TEST_PLAIN:
            return text
        return "\n".join(ln for ln in text.splitlines() if not ln.startswith(tuple(t + " " for t in tags))) + "\n"

    return edit


def _rewrite_tag(target: str, tag: str, change):
    def edit(case_id: str, text: str) -> str:
        if case_id != target:
            return text
        out = []
        for ln in text.splitlines():
            if ln.startswith(tag + " "):
                ln = f"{tag} {json.dumps(change(json.loads(ln[len(tag) + 1 :])))}"
            out.append(ln)
        return "\n".join(out) + "\n"

    return edit


def _zero_checks(d: dict) -> dict:
    d = dict(d)
    if "checks" in d:
        d["checks"] = 0
    if isinstance(d.get("counters"), dict):
        d["counters"] = {**d["counters"], "checks": 0}
    return d


def _other_backend(d: dict) -> dict:
    """What a FLASHINFER engine would report: another backend, no forward through FlashAttentionImpl."""
    d = {**d, "attention_backend_requested": "FLASHINFER", "attention_backend": "FLASHINFER", "fa_version": None}
    for key in ("counters",):
        if isinstance(d.get(key), dict):
            d[key] = {**d[key], "attention_forwards": 0, "fa_versions": {}}
    if "attention_forwards" in d:
        d["attention_forwards"], d["fa_versions"] = 0, {}
    return d


def _other_backend_both(case_id: str, text: str) -> str:
    text = _rewrite_tag(UNDER_TEST_PLAIN, ENGINE_TAG, _other_backend)(case_id, text)
    return _rewrite_tag(UNDER_TEST_PLAIN, COUNTERS_TAG, _other_backend)(case_id, text)


def _zero_audit(case_id: str, text: str) -> str:
    for tag in (ENGINE_TAG, COUNTERS_TAG, AUDIT_TAG):
        text = _rewrite_tag(UNDER_TEST_AUDIT, tag, _zero_checks)(case_id, text)
    return text


@pytest.mark.parametrize(
    "edit,case_id,why",
    [
        (_drop_tags(ENGINE_TAG, COUNTERS_TAG), UNDER_TEST_PLAIN, "reported no engine configuration and no counters"),
        (_zero_audit, UNDER_TEST_AUDIT, "the freshness auditor made 0 checks"),
        (_other_backend_both, UNDER_TEST_PLAIN, "no attention forward went through the hooked FLASH_ATTN impl"),
    ],
    ids=["no-engine-lines", "audit-0-checks", "another-backend"],
)
def test_a_case_whose_feature_did_not_fire_cannot_vouch(monkeypatch, tmp_path, edit, case_id, why):
    run = replay(monkeypatch, tmp_path, edit)
    verdicts = {c.case_id: r for c, r in run.cases}
    r = verdicts[case_id]
    assert r.verdict == CANNOT_VOUCH and why in r.reason, r.reason
    assert "case verdict would have been clean" in r.reason
    others = {k: v.verdict for k, v in verdicts.items() if k != case_id}
    assert others == {k: ROWS[k]["verdict"] for k in others}  # only the edited case changed
    assert [c.case_id for c, _ in run.not_vouched()] == [case_id]
    assert run.outcome() == "CANNOT VOUCH" and gate_exit(run.outcome()) == 4
    md = gate_report.markdown(run, DOC["environment"])
    assert "**Gate: CANNOT VOUCH**" in md and f"CANNOT VOUCH: {case_id}: " in md
