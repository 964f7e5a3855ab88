"""vLLM 0.34.0 through the gate with every speculative method the harness builds a pair for, and source mutants of
0.34.0 that build a draft capture's metadata for another descriptor (results/h200-methods-0.34.0,
results/h200-methods-0.34.0-2, results/h200-mutants-0.34.0; written by the gate on the H200): each method's self control
is caught in both injection forms, by the auditor's contents check in audit mode; a method whose constructed draft
does not agree is CANNOT VOUCH (never clean), and once its weights agree (EAGLE3's, -2) every method is clean and the
gate passes; each mutant is caught by the audit's descriptor check on its own capture path and nowhere else."""

from __future__ import annotations

import re

import pytest

from tests.records import RESULTS, load

METHODS = load(RESULTS / "h200-methods-0.34.0" / "results.json")
AGREEING = load(RESULTS / "h200-methods-0.34.0-2" / "results.json")  # EAGLE3 weights that agree
MUTANTS = load(RESULTS / "h200-mutants-0.34.0" / "results.json")


def _stale(case: dict) -> int:
    """The stale fields the audit counted in a case (its evidence line: "audit: N stale fields ...")."""
    return int(re.search(r"audit: (\d+) stale fields", case["evidence"] or "")[1])


def _rows(doc: dict) -> dict[str, dict]:
    return {c["case"]: c for c in doc["cases"]}


def _every_agreeing_method_clean_and_every_self_control_caught(
    doc: dict, release: str, methods: tuple[str, ...], controls_run: int, verdicts: set[str]
) -> None:
    """The builds under test of each method in `methods` (case-id infixes; eagle's is "") clean with the draft accepted
    as in the reference; the self controls that ran (not applicable ones aside) `controls_run` in number, half of them
    the stale-descriptor form, with exactly these `verdicts`, and in audit mode each seen by the auditor itself."""
    rows = _rows(doc)
    for method in methods:
        for mode in ("audit", "plain"):
            case = rows[f"stale_metadata-vllm-{release}-under-test{method}-compile-none-{mode}"]
            assert case["verdict"] == "clean", case["reason"]
            assert "100%" in case["evidence"]  # the draft accepted as in its reference
    controls = [
        c
        for c in rows.values()
        if "-self-control-" in c["case"] and c["case"].endswith(("audit", "plain")) and c["verdict"] != "skip"
    ]
    assert len(controls) == controls_run and {c["verdict"] for c in controls} == verdicts
    assert sum("stale-descriptor" in c["case"] for c in controls) == controls_run // 2
    for c in controls:  # in audit mode the auditor itself saw the re-created defect, not only the fault
        assert not c["case"].endswith("audit") or _stale(c) > 0, c
        # the second form (one capture's metadata built for another descriptor) is seen as that by the auditor
        if "stale-descriptor" in c["case"] and c["case"].endswith("audit"):
            assert re.search(r"\(([1-9]\d*) of them stale-descriptor\)", c["evidence"]), c


def test_every_method_that_agrees_is_clean_and_every_self_control_form_is_caught():
    methods = ("", "-draft-model", "-mtp")  # eagle's ids name no method
    _every_agreeing_method_clean_and_every_self_control_caught(METHODS, "0.34.0", methods, 16, {"crash"})


def test_with_eagle3_weights_that_agree_every_method_is_clean_and_the_gate_passes():
    assert AGREEING["outcome"] == "PASS"
    methods = ("", "-eagle3", "-draft-model", "-mtp")
    _every_agreeing_method_clean_and_every_self_control_caught(AGREEING, "0.34.0", methods, 16, {"crash"})
    rows = _rows(AGREEING)
    assert (
        "48 of 48 draft tokens accepted"
        in rows["stale_metadata-vllm-0.34.0-under-test-eagle3-reference-sm-all"]["evidence"]
    )


def test_a_method_whose_draft_does_not_agree_is_cannot_vouch_never_clean():
    assert METHODS["outcome"] == "CANNOT VOUCH"
    rows = _rows(METHODS)
    ref = rows["stale_metadata-vllm-0.34.0-under-test-eagle3-reference-sm-all"]
    assert ref["verdict"] == "error" and "0 of 180 draft tokens accepted" in ref["reason"]
    for mode in ("audit", "plain"):
        assert rows[f"stale_metadata-vllm-0.34.0-under-test-eagle3-compile-none-{mode}"]["verdict"] == "error"


def test_each_mutant_is_caught_by_the_descriptor_check_on_its_own_path_only():
    assert MUTANTS["outcome"] == "AFFECTED"
    rows = _rows(MUTANTS)
    hit = {"td": "", "sa": "-draft-model"}  # target-dependent (eagle) and standalone (draft_model) capture paths
    for mutant, method in hit.items():
        for other in ("", "-draft-model"):
            case = rows[f"stale_metadata-vllm-0.34.0-{mutant}-under-test{other}-compile-none-audit"]
            if other == method:
                assert case["verdict"] != "clean" and "stale-descriptor" in case["evidence"], case
                assert _stale(case) > 0
            else:
                assert case["verdict"] == "clean" and _stale(case) == 0, case


RELEASE_032 = load(RESULTS / "h200-methods-0.32.0" / "results.json")  # vLLM 0.32.0 on torch 2.13


def test_a_release_on_torch_2_13_passes_with_each_method_it_captures_and_draft_model_not_applicable():
    assert RELEASE_032["outcome"] == "PASS"
    _every_agreeing_method_clean_and_every_self_control_caught(
        RELEASE_032, "0.32.0", ("", "-eagle3", "-mtp"), 12, {"crash", "wrong-output"}
    )
    rows = _rows(RELEASE_032)
    for form in ("under-test", "self-control", "self-control-stale-descriptor"):
        for mode in ("audit", "plain"):
            case = rows[f"stale_metadata-vllm-0.32.0-{form}-draft-model-compile-none-{mode}"]
            assert case["verdict"] == "skip" and "capture() records nothing" in case["reason"], case
    # the stale-descriptor form of eagle's self control did not fault on 0.32.0: the agreeing draft caught it
    case = rows["stale_metadata-vllm-0.32.0-self-control-stale-descriptor-compile-none-plain"]
    assert case["verdict"] == "wrong-output" and "0 of 180 draft tokens accepted" in case["evidence"]


DFLASH = load(RESULTS / "h200-dflash-0.34.0" / "results.json")  # --methods dflash, cut by a short --deadline


def test_the_dflash_pair_agrees_on_the_gpu_and_cases_the_deadline_cut_are_cannot_vouch_never_clean():
    rows = _rows(DFLASH)
    ref = rows["stale_metadata-vllm-0.34.0-under-test-dflash-reference-sm-all"]
    assert ref["verdict"] == "clean" and "draft 48 of 48 draft tokens accepted (100%)" in ref["evidence"]
    assert ref["engine"]["speculative_method"] == "dflash"
    cut = [c for c in rows.values() if not c["case"].endswith("reference-sm-all")]
    assert len(cut) == 6 and all(c["verdict"] == "skip" and "--deadline" in c["reason"] for c in cut)
    assert DFLASH["outcome"] == "CANNOT VOUCH"


def test_dflash_recorded_harness_blind_on_a_harmless_form_replays_as_a_pass_with_the_form_listed(monkeypatch, tmp_path):
    """results/h200-dflash-0.34.0-2 (written before policy rule 6): DFlash clean in audit and plain with its draft
    accepted; both self-control forms caught by the auditor; in plain the stale-descriptor form crashed and the
    stale-capture form decoded right, 48 of 48 draft tokens accepted (the query graph recomputes what it wrote), which the policy of that day called
    HARNESS BLIND. Replayed from its logs with today's code: the same verdicts, PASS, the silent form listed."""
    from tests.recorded_gate import replayed

    doc, rows, run, got = replayed(monkeypatch, tmp_path, "h200-dflash-0.34.0-2")
    assert doc["outcome"] == "HARNESS BLIND"
    plain = "stale_metadata-vllm-0.34.0-self-control-dflash-compile-none-plain"
    assert [b.split(":")[0] for b in doc["blind"]] == [plain]
    acc = rows[plain]["result"]["backend_identity"]["acceptance"]  # the silent form's draft: every token accepted
    assert rows[plain]["verdict"] == "clean" and acc["spec_decode_num_accepted_tokens"] == 48
    assert acc["spec_decode_num_draft_tokens"] == 48
    for mode in ("audit", "plain"):
        assert rows[f"stale_metadata-vllm-0.34.0-under-test-dflash-compile-none-{mode}"]["verdict"] == "clean"
    for form in ("", "-stale-descriptor"):  # every form seen by the auditor itself
        assert _stale(rows[f"stale_metadata-vllm-0.34.0-self-control{form}-dflash-compile-none-audit"]) > 0
    assert rows["stale_metadata-vllm-0.34.0-self-control-stale-descriptor-dflash-compile-none-plain"]["verdict"] == (
        "crash"
    )
    assert run.judge().outcome == "PASS", run.blind()
    (miss,) = run.judged().decision.form_misses
    assert miss.startswith(f"{plain}: clean (caught by ") and "stale-descriptor" in miss


# the code of 834ae10, a later code, and the one-forkserver code (14085c4)
ALL_FIVE_RECORDS = ("h200-methods-0.34.0-3", "h200-methods-0.34.0-4", "h200-methods-0.34.0-5")


@pytest.mark.parametrize("name", ALL_FIVE_RECORDS)
def test_every_method_dflash_included_is_clean_every_form_caught_by_the_audit_and_the_gate_passes(name):
    """results/h200-methods-0.34.0-3 and -4 (the gate's weights built on the GPU, cases forked): the five methods of `--methods all` clean in audit and plain; every self control
    caught in both forms, in audit by the auditor's own count; in plain every form faulted but DFlash's stale-capture
    form, which decoded right (its query graph recomputes what that form wrote) beside its crashed stale-descriptor
    form: listed by rule 6, and the gate passed."""
    ALL_FIVE = load(RESULTS / name / "results.json")
    assert ALL_FIVE["outcome"] == "PASS"
    methods = ("", "-eagle3", "-draft-model", "-mtp", "-dflash")
    _every_agreeing_method_clean_and_every_self_control_caught(
        ALL_FIVE, "0.34.0", methods, 20, {"crash", "clean", "stale-audit"}
    )
    rows = _rows(ALL_FIVE)
    silent = [c["case"] for c in rows.values() if "-self-control" in c["case"] and c["verdict"] == "clean"]
    plain = "stale_metadata-vllm-0.34.0-self-control-dflash-compile-none-plain"
    assert silent == [plain, f"{plain}-attempt2", f"{plain}-attempt3"]  # each of its attempts decoded right
    assert rows[plain]["expected"] == "any-form"
    assert rows["stale_metadata-vllm-0.34.0-self-control-stale-descriptor-dflash-compile-none-plain"]["verdict"] == (
        "crash"
    )
    assert any("rule 6" in line and silent[0] in line for line in ALL_FIVE["decision"])


DFLASH_MUTANT = load(RESULTS / "h200-mutant-dflash-0.34.0" / "results.json")


def test_the_dflash_capture_builder_mutant_is_affected_and_its_audit_finds_every_draft_capture_stale():
    """results/h200-mutant-dflash-0.34.0: scripts/mutate_vllm.py's dflash-wrong-descriptor (DFlashCudaGraphManager
    builds each FULL descriptor's metadata for its neighbour) as a build under test: AFFECTED, its draft wrong in
    both modes (its draft accepted 39 of 87 where its reference accepted all), and in audit every audited draft-query
    capture stale, every stale field one of another descriptor, none of the target's captures."""
    assert DFLASH_MUTANT["outcome"] == "AFFECTED"
    rows = _rows(DFLASH_MUTANT)
    for mode in ("audit", "plain"):
        case = rows[f"stale_metadata-vllm-0.34.0-df-under-test-dflash-compile-none-{mode}"]
        assert case["verdict"] == "wrong-output", case
    audit = rows["stale_metadata-vllm-0.34.0-df-under-test-dflash-compile-none-audit"]
    # the tokens still equal the reference (the target verifies every draft token): the draft and the audit show it
    assert "draft: 39 of 87 draft tokens accepted" in audit["evidence"]
    assert _stale(audit) > 0 and re.search(rf"\({_stale(audit)} of them stale-descriptor\)", audit["evidence"])
    counters = audit["counters"]
    assert counters["captures_stale"] == {"draft query": counters["captures_audited"]["draft query"]}
    assert counters["captures_audited"]["draft query"] > 0
