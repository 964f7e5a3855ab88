"""The self control on the H200, judged again on a CPU from its records: the defect re-created inside 0.26.0, 0.25.1
and 0.33.0 (repro.vllm_integration.plugin.inject) beside 0.25.1 as it is, and a source mutant of 0.33.0 with PR #48261
reverted in spirit. Every verdict comes back from the logs and channel files; the fidelity table and which kind of
control each mode relied on are recomputed, not read."""

from __future__ import annotations

import json

from repro.contract.channel import Channel
from repro.contract.tags import DEVICE_TAG
from repro.exit_codes import gate as gate_exit
from repro.vllm_integration.gate.judge import platform_problem
from repro.vllm_integration.gate.report import fidelity, markdown
from tests.recorded_gate import replay
from tests.records import RESULTS

V = "stale_metadata-vllm-"


def _same_verdicts(rows, got):
    assert set(got) == set(rows)
    for case_id, row in rows.items():
        assert (got[case_id].verdict, got[case_id].kernel) == (row["verdict"], row["result"]["kernel"]), case_id


def test_the_injection_reproduces_0251_as_it_is(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-selfcontrol-fidelity")
    _same_verdicts(rows, got)
    table = {(x["mode"], x["control"]): x for x in fidelity(run)}
    for mode in ("audit", "plain", "mps:16"):  # 0.25.1 injected: what 0.25.1 as it is shows
        real, injected = table[(mode, "0.25.1 as it is")], table[(mode, "0.25.1 injected")]
        assert (injected["verdict"], injected["kernel"]) == (real["verdict"], real["kernel"]), mode
        assert injected["stale_fields"] == real["stale_fields"] and injected["descriptor"] == real["descriptor"]
    assert table[("plain", "0.25.1 injected")]["kernel"] == "combine"  # named by its launch-blocking rerun
    assert table[("sm_margin:16", "0.25.1 injected")]["verdict"] == "hang"  # kernel evidence of another kind
    fresh = table[("audit", "0.26.0 injected")]
    assert fresh["verdict"] == "stale-audit" and fresh["descriptor"] == "t512r128"
    assert set(fresh["stale_fields"]) == {"query_start_loc", "seq_lens", "scheduler_metadata.prepare_seqlen_q"}
    assert table[("sm_margin:16", "0.26.0 injected")]["verdict"] == "crash"
    # the self control of the fixed build is missed by the plain and MPS modes: the gate says so, it never passes
    assert [table[(m, "0.26.0 injected")]["verdict"] for m in ("plain", "mps:16")] == ["clean", "clean"]
    assert run.outcome() == doc["outcome"] == "HARNESS BLIND" and gate_exit(run.outcome()) == 3
    assert run.decision().summary() == doc["decision"]
    plain = next(x for x in doc["decision"] if "mode plain:" in x)
    assert "known-bad build: 1 of 1; self-control: 1 of 2" in plain
    assert "0.26.0 (self control) | self-control | 0.26.0 | **defect re-created: caught**" in markdown(run)
    injected = got[V + "0.26.0-self-control-audit"].backend_identity
    assert injected["injection"] and injected["counters"]["captures_injected"] == {
        "draft prefill": 49,
        "draft decode": 51,
    }


def test_0330_with_its_self_control_and_a_source_mutant(monkeypatch, tmp_path):
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-vllm-0.33-selfcontrol")
    _same_verdicts(rows, got)
    assert [got[V + f"0.33.0-under-test-{m}"].verdict for m in ("audit", "smmargin16")] == ["clean", "clean"]
    assert [got[V + f"0.33.0-self-control-{m}"].verdict for m in ("audit", "smmargin16")] == ["hang", "hang"]
    mutant = got[V + "0.33.0-mutant-under-test-audit"]
    assert mutant.verdict == "stale-audit" and mutant.descriptor
    assert got[V + "0.33.0-mutant-under-test-smmargin16"].verdict == "clean"  # its kernels stayed silent
    c = got[V + "0.33.0-under-test-audit"].backend_identity["counters"]
    assert c["spec_layout"] == "target_dependent_ar" and c["spec_layout_known"]
    assert c["draft_refreshes_in_graph"] > 0 and c["fa_versions"] == {"3": c["attention_forwards"]}
    assert run.outcome() == doc["outcome"] == "AFFECTED"  # the mutant
    audit = next(x for x in doc["decision"] if "mode audit:" in x)
    assert "(self-control: 2 of 2)" in audit  # no known-bad build in torch 2.14's environment: the self controls
    refs = {c.case_id: r for c, r in run.references}
    assert all("reference validated: 64 tokens, finite, not degenerate" in r.evidence for r in refs.values())


def test_a_broken_reference_is_never_ground_truth(monkeypatch, tmp_path):
    """The mps:24 failure of the previous round, re-created on a real record: a reference whose log-probabilities are
    NaN after its first token (the tokens then one id repeated) is an error, and the build's cases cannot vouch;
    without the validation the same tokens read as wrong output, a false AFFECTED."""
    ref_id = V + "0.33.0-under-test-reference-sm-all"

    def nan_reference(case_id, text):
        if case_id != ref_id:
            return text
        out = []
        for line in text.splitlines():
            if line.strip():
                rec = json.loads(line)
                if rec["tag"] == "REPRO_RESULT":
                    body = rec["data"]
                    body["tokens"] = [[t[0]] + [1023] * (len(t) - 1) for t in body["tokens"]]
                    body["margins"] = [[m[0]] + [None] * (len(m) - 1) for m in body["margins"]]
                    body["nonfinite"] = [f"request {i} token {j}" for i in range(4) for j in range(1, 16)]
                line = json.dumps(rec)
            out.append(line)
        return "\n".join(out) + "\n"

    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-vllm-0.33-selfcontrol", nan_reference)
    ref = got[ref_id]
    assert ref.verdict == "error" and "non-finite log-probabilities" in ref.reason and "degenerate" in ref.reason
    case = got[V + "0.33.0-under-test-audit"]
    assert case.verdict == "error" and "no reference to compare with" in case.reason
    assert V + "0.33.0-under-test-audit" not in {c.case_id for c, r in run.cases if r.verdict == "wrong-output"}


def test_the_mps24_reference_that_decoded_nan_is_an_error(monkeypatch, tmp_path):
    """The H200's own broken reference (MPS at 24 SMs, results/h200-vllm-mps24-reference): NaN log-probabilities and
    one id repeated. Judged again from its channel file, it is an error and the build cannot be vouched for there; the
    same tokens read without validation would be wrong output (a false AFFECTED, as in the previous round)."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-vllm-mps24-reference")
    _same_verdicts(rows, got)
    ref = got[V + "0.26.0-under-test-reference-mps24"]
    assert ref.verdict == "error" and "57 position(s)" in ref.reason and "repeats 1023" in ref.reason
    assert got[V + "0.26.0-under-test-mps24"].verdict == "error"
    assert run.outcome(need_control=False) == doc["outcome"] == "CANNOT VOUCH" and gate_exit(doc["outcome"]) == 4


def _acceptance(res):
    acc = (res.backend_identity or {}).get("acceptance") or {}
    return acc.get("spec_decode_num_accepted_tokens"), acc.get("spec_decode_num_draft_tokens")


def test_agreement_weights_first_source_self_control_caught_in_every_mode(monkeypatch, tmp_path):
    """results/h200-agree-selfcontrol (the code's defaults: `agree` weights, the self control's first source): the
    healthy build's draft is accepted whole, its references are validated with margins of ~19 nats, and the self
    control faults in every mode; 0.25.1 as it is is caught only by audit, sm_margin:16 and mps:16 (hangs), and the
    MPS server a faulting client left behind refused the next reference (the run this record came from had no
    daemon restart: that reference is an error, and the gate cannot vouch)."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-agree-selfcontrol")
    _same_verdicts(rows, got)
    for m in ("audit", "plain", "smmargin16"):
        res = got[V + f"0.26.0-under-test-{m}"]
        assert res.verdict == "clean" and _acceptance(res) == (48, 48), m
        assert "draft: 48 of 48 draft tokens accepted (100%), reference 100%" in res.evidence
    assert [got[V + f"0.26.0-self-control-{m}"].verdict for m in ("audit", "plain", "smmargin16", "mps16")] == [
        "crash"
    ] * 4
    assert [got[V + f"0.25.1-control-{m}"].verdict for m in ("audit", "plain", "smmargin16", "mps16")] == [
        "stale-audit",
        "clean",
        "hang",
        "hang",
    ]
    ref = next(r for c, r in run.references if c.case_id == V + "0.26.0-under-test-reference-sm-all")
    assert "smallest top-2 margin" in ref.evidence and "48 of 48" in ref.evidence
    assert run.outcome() == doc["outcome"] == "CANNOT VOUCH"


def test_the_known_bad_builds_fault_depends_on_the_models_weights(monkeypatch, tmp_path):
    """0.25.1 as it is, plain and sm_margin:16 on the full H200: with `margin` weights (random, near ties) it crashes
    in both (results/h200-margin-weights-0.25.1); with `agree` weights the same build decodes cleanly in plain
    (results/h200-agree-selfcontrol) and only its audit, a hang or the self control show the defect."""
    _, rows, _, got = replay(monkeypatch, tmp_path, RESULTS / "h200-margin-weights-0.25.1")
    _same_verdicts(rows, got)
    assert [got[V + f"0.25.1-under-test-{m}"].verdict for m in ("plain", "smmargin16")] == ["crash", "crash"]


def test_mps24_is_broken_in_both_builds_whatever_the_weights(monkeypatch, tmp_path):
    """results/h200-agree-exact-first-source: at mps:24 the eager reference decodes NaN again with the agreement
    weights (the cause is not the weights), the graph case accepts 1 of 177 draft tokens, and the gate cannot vouch
    instead of answering AFFECTED."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-agree-exact-first-source")
    _same_verdicts(rows, got)
    ref = next(r for c, r in run.references if c.case_id == V + "0.26.0-under-test-reference-mps24")
    assert ref.verdict == "error" and "non-finite" in ref.reason
    assert got[V + "0.26.0-under-test-mps24"].verdict == "error"
    assert run.outcome() == doc["outcome"] == "CANNOT VOUCH"


def test_0330_alone_passes_with_its_self_control_caught_in_every_mode(monkeypatch, tmp_path):
    """vLLM 0.33.0 (torch 2.14 through --torch) with no known-bad build: the self control, with the object half of
    the defect (inject.reuse), faults in audit, plain (combine named) and mps:16; the build is clean in all three,
    its draft accepted 144 of 144 tokens: PASS from the build's own environment."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-vllm-0.33-alone")
    _same_verdicts(rows, got)
    modes = ("audit", "plain", "mps16")
    assert [got[V + f"0.33.0-under-test-{m}"].verdict for m in modes] == ["clean"] * 3
    assert [got[V + f"0.33.0-self-control-{m}"].verdict for m in modes] == ["crash"] * 3
    assert got[V + "0.33.0-self-control-plain"].kernel == "combine"
    c = got[V + "0.33.0-self-control-audit"].backend_identity["counters"]
    assert c["inject_reused"]["capture"] > 0 and c["captures_injected"]["draft decode"] > 0
    assert run.outcome() == doc["outcome"] == "PASS" and gate_exit(run.outcome()) == 0
    assert run.decision().summary() == doc["decision"]
    for m in ("audit", "plain", "mps:16"):
        assert any(
            f"mode {m}: 1 of 1 positive control(s) showed evidence (self-control: 1 of 1)" in x for x in doc["decision"]
        )
    acc = got[V + "0.33.0-under-test-plain"].backend_identity["acceptance"]
    assert acc["spec_decode_num_accepted_tokens"] == acc["spec_decode_num_draft_tokens"] > 0


def test_both_halves_of_the_injection_still_fault_0260_and_a_known_bad_build_silent_in_plain_is_a_listed_miss(
    monkeypatch, tmp_path
):
    """0.26.0 with the injection's object half added (inject.reuse): its self control faults in audit and plain; the
    build is clean; 0.25.1 as it is decodes cleanly in plain with the agreement weights but its audit caught it. The
    run said HARNESS BLIND when it was recorded; under policy rule 5 (a known-bad build judged over all its modes) the
    same records PASS, the plain miss listed, and the plain mode vouched for by the self control's crash."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-injection-both-halves-0.26.0")
    _same_verdicts(rows, got)
    assert [got[V + f"0.26.0-under-test-{m}"].verdict for m in ("audit", "plain")] == ["clean", "clean"]
    assert [got[V + f"0.26.0-self-control-{m}"].verdict for m in ("audit", "plain")] == ["crash", "crash"]
    assert (
        got[V + "0.25.1-control-plain"].verdict == "clean" and got[V + "0.25.1-control-audit"].verdict == "stale-audit"
    )
    assert doc["outcome"] == "HARNESS BLIND"  # the rule it was recorded under
    assert run.outcome() == "PASS" and gate_exit(run.outcome()) == 0 and not run.blind()
    d = run.decision()
    assert d.misses == [V + "0.25.1-control-plain: clean (detected in audit)"]
    assert d.evidence_by_kind["plain"] == {"known-bad build": (1, 0), "self-control": (1, 1)}


def test_at_mps24_the_platform_is_named_never_a_false_alarm(monkeypatch, tmp_path):
    """Under MPS at 24 SMs the H200's bf16 GEMMs are wrong with torch 2.11 and with torch 2.14: every case process's
    GEMM check fails first, so 0.26.0, 0.33.0 and 0.33.0's self control are errors naming the products, and the gate
    cannot vouch (exit 4): no AFFECTED from NaN references any more."""
    for record in ("h200-mps24-gemm-check-0.26.0", "h200-mps24-gemm-check-0.33.0"):
        doc, rows, run, got = replay(monkeypatch, tmp_path / record, RESULTS / record)
        _same_verdicts(rows, got)
        assert all(r.verdict == "error" and "bf16 matrix products wrong" in r.reason for r in got.values()), record
        need = "--no-control" not in doc["environment"]["command"]
        assert run.outcome(need_control=need) == doc["outcome"] == "CANNOT VOUCH" and gate_exit("CANNOT VOUCH") == 4


def test_mps_above_16_sms_is_a_platform_problem_on_the_h200_and_8_and_16_are_right():
    """results/h200-sweep-mps-b, h200-sweep-mps-a: every process under MPS at 40 SMs (as at 24) reported a failed bf16
    GEMM check in its own DEVICE record, and the gate turned each into an error that names the products and the SM
    count (never a verdict on the build); at 8 and 16 SMs the same check passed."""

    def devices(record: str, mode: str):
        for f in sorted((RESULTS / record / "logs").glob(f"*-{mode}*.channel.jsonl")):
            for data in Channel.read(f).of(DEVICE_TAG):
                yield f.name, data

    wrong = dict(devices("h200-sweep-mps-b", "mps40"))
    assert len(wrong) == 2 and all(d["sms"] == 40 and platform_problem(d) for d in wrong.values())
    assert all("(40 SMs: max error 3.7783" in platform_problem(d) for d in wrong.values())
    rows = {r["case"]: r for r in json.loads((RESULTS / "h200-sweep-mps-b" / "results.json").read_text())["cases"]}
    for case in ("stale_metadata-vllm-0.25.1-control-audit-mps40", "stale_metadata-vllm-0.25.1-control-mps40"):
        assert "bf16 matrix products wrong here (40 SMs" in rows[case]["reason"]
    right = [d for m in ("mps8", "mps16") for _, d in devices("h200-sweep-mps-a", m)]
    assert right and all(d["sms"] in (8, 16) and platform_problem(d) is None for d in right)


def test_once_a_process_finds_the_sm_configuration_computing_wrong_no_other_process_runs_in_it(monkeypatch, tmp_path):
    """h200-mps24-gemm-check-0.33.0: the build under test and its reference ran first (side by side under the daemon),
    and both GEMM checks failed at 24 SMs; the self control in the same configuration is then an error that names
    one of them, without a process of its own (it would take 20-60 s to find the same); the gate cannot vouch."""
    doc, rows, run, got = replay(monkeypatch, tmp_path, RESULTS / "h200-mps24-gemm-check-0.33.0")
    _same_verdicts(rows, got)
    batch = ("stale_metadata-vllm-0.33.0-under-test-mps24", "stale_metadata-vllm-0.33.0-under-test-reference-mps24")
    assert all("bf16 matrix products wrong here (24 SMs" in got[k].reason for k in batch)
    control = got["stale_metadata-vllm-0.33.0-self-control-mps24"]
    assert any(control.reason.startswith(f"not run: {k}'s process found this GPU computes bf16") for k in batch)
    assert not (tmp_path / "logs" / "stale_metadata-vllm-0.33.0-self-control-mps24.out.log").exists()
    assert run.outcome() == "CANNOT VOUCH"


def test_the_platform_memo_stays_in_its_mps_configuration(monkeypatch, tmp_path):
    """h200-selfcontrol-fidelity (audit, plain, sm_margin:16, mps:16, both builds and their self controls) replayed
    with a failed GEMM check added to two processes' records (as their last DEVICE record): 0.26.0's mps:16 case,
    which runs first (beside 0.26.0's reference), and 0.26.0's audit case on the full GPU. Every mps:16 case started
    after it is an error naming it, with no process of its own and no
    rerun; sm_margin:16 and the full GPU's other cases keep their recorded verdicts (no memo off MPS)."""
    finder, full = f"{V}0.26.0-under-test-mps16", f"{V}0.26.0-under-test-audit"

    def failed_check(case_id: str, text: str) -> str:
        if case_id not in (finder, full):
            return text
        sms = 16 if case_id == finder else 132
        data = {"gpu": "NVIDIA H200", "sms": sms, "gemm_check": {"max_error": 5.78, "tolerance": 0.1, "ok": False,
                "worst": "19x1024x1536"}}  # fmt: skip
        return text.rstrip("\n") + "\n" + json.dumps({"schema": 1, "tag": DEVICE_TAG, "pid": 1, "data": data}) + "\n"

    doc, rows, run, got = replay(
        monkeypatch, tmp_path, RESULTS / "h200-selfcontrol-fidelity", edit_channel=failed_check
    )
    assert got[finder].verdict == "error" and "bf16 matrix products wrong here (16 SMs" in got[finder].reason
    beside = f"{V}0.26.0-under-test-reference-mps16"  # in the finder's batch of two MPS clients, started with it
    not_run = f"not run: {finder}'s process found"
    # on the GPU both start before either ends; replayed, the finder may end before its neighbour's thread starts
    assert got[beside].verdict == rows[beside]["verdict"] == "clean" or got[beside].reason.startswith(not_run)
    others = [k for k in got if k.endswith("mps16") and k not in (finder, beside)]
    assert len(others) == 4  # 0.26.0's self control, 0.25.1 and its self control, 0.25.1's reference (next batch)
    for k in others:
        assert got[k].verdict == "error" and got[k].reason.startswith(not_run), k
        assert not (tmp_path / "logs" / f"{k}.out.log").exists()
    assert not any(r["case"] == finder for r in run.mps_reruns)  # no neighbour causes it: never rerun
    assert got[full].verdict == "error" and "(132 SMs" in got[full].reason
    untouched = [k for k in rows if k not in others and k not in (finder, full, beside)]
    assert untouched and all(got[k].verdict == rows[k]["verdict"] for k in untouched)
