"""A gate asked only for methods a build under test does not have (`--methods eagle_dynamic_k` on a build without
dynamic speculative decoding): nothing of that build can run, so the answer is CANNOT VOUCH naming the method and why,
never HARNESS BLIND (the harness is not what failed) nor PASS; `--dry-run` lists no case of it and says why on
stderr. Stand-in builds (tests/fake_vllm.py): their files lack num_speculative_tokens_per_batch_size."""

from __future__ import annotations

from repro.judge.decision import GateOutcome
from repro.vllm_integration.gate import why as gate_why
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.releases.builds import UNDER_TEST, parse_builds
from tests.commands import main_in
from tests.fake_vllm import write_fake_vllm


def test_only_methods_the_build_lacks_is_cannot_vouch_naming_why_never_blind(tmp_path):
    good = parse_builds(f"good={write_fake_vllm(tmp_path / 'good', '0.34.0', 'good')}", UNDER_TEST, "x")
    run = run_gate(good, parse_modes("audit,plain"), tmp_path / "logs", jobs=2, launcher="spawn",
                   methods=("eagle_dynamic_k",))  # fmt: skip
    assert run.cases and all(r.not_applicable for _, r in run.cases) and not run.references
    assert run.unanswered() == {"good": run.cases[0][1].not_applicable}
    assert run.outcome() == GateOutcome.CANNOT_VOUCH
    causes = gate_why.causes(run)
    assert causes[0].startswith("none of the methods asked for applies to build good: dynamic speculative decoding")
    # beside a method the build has, the lacking one is listed as not applicable and the build is answered
    both = run_gate(good, parse_modes("audit,plain"), tmp_path / "logs2", jobs=2, launcher="spawn",
                    methods=("eagle", "eagle_dynamic_k"))  # fmt: skip
    assert both.unanswered() == {} and both.outcome() == GateOutcome.PASS


def test_the_dry_run_lists_only_what_would_start_and_says_what_does_not_apply(tmp_path):
    prefix = write_fake_vllm(tmp_path / "good", "0.34.0", "good")
    base = ["gate", "--dry-run", "--no-installed", "--vllm", f"x={prefix}"]
    r = main_in([*base, "--methods", "eagle_dynamic_k"], tmp_path)
    assert r.returncode == 0 and r.stdout == ""
    assert r.stderr.count("not applicable (no process): stale_metadata-vllm-x-") == 8  # audit, plain; build, 3 forms
    assert "would answer CANNOT VOUCH" in r.stderr
    r = main_in([*base, "--methods", "eagle,eagle_dynamic_k"], tmp_path)
    assert r.returncode == 0 and len(r.stdout.split()) == 6 and "would answer" not in r.stderr
    other = write_fake_vllm(tmp_path / "other", "0.34.0", "good")  # each build under test answered for itself
    r = main_in([*base, "--vllm", f"y={other}", "--methods", "eagle_dynamic_k"], tmp_path)
    assert [ln.split(": ")[1] for ln in r.stderr.splitlines() if "would answer" in ln] == [
        "none of the methods asked for applies to build x",
        "none of the methods asked for applies to build y",
    ]


def test_a_self_control_form_the_build_cannot_re_create_is_not_applicable_and_stale_k_is_the_dynamic_methods(tmp_path):
    from pathlib import Path

    from repro.vllm_integration.gate.case import plan
    from repro.vllm_integration.gate.methods import form_not_applicable
    from repro.vllm_integration.gate.process import set_apart_not_applicable
    from repro.vllm_integration.plugin.inject import STALE_CAPTURE, STALE_K, STALE_REFRESH
    from repro.vllm_integration.releases.builds import VllmBuild

    backends = Path("v1") / "attention" / "backends"
    old, new = tmp_path / "old" / "vllm", tmp_path / "new" / "vllm"
    for root, body in (
        (old, "    def build(self): ...\n"),
        (new, "    def update_draft_decode_metadata(self, m): ...\n"),
    ):
        (root / backends).mkdir(parents=True)
        (root / backends / "flash_attn.py").write_text(f"class FlashAttentionMetadataBuilder:\n{body}")
    why = form_not_applicable(old, STALE_REFRESH, "FLASH_ATTN")
    assert why == "self-control form stale-refresh: this build's FLASH_ATTN builder has no update_draft_decode_metadata"
    assert form_not_applicable(new, STALE_REFRESH, "FLASH_ATTN") is None
    assert form_not_applicable(old, STALE_CAPTURE, "FLASH_ATTN") is None  # the other forms need no refresh
    build = VllmBuild("old", str(old.parent), UNDER_TEST)
    cases = plan([build], parse_modes("audit"), 1, 60.0, forms=(STALE_CAPTURE, STALE_REFRESH))
    runs, na = set_apart_not_applicable(cases)
    assert [c.inject for c in runs] == [None, STALE_CAPTURE] and [(c.inject, r.not_applicable) for c, r in na] == [
        (STALE_REFRESH, why)
    ]
    # stale-k: a dynamic-K method's own form, once; no other method gets it, even when asked for
    dyn = plan([build], parse_modes("audit"), 1, 60.0, methods=("eagle_dynamic_k", "eagle"), forms=(STALE_K,))
    ids = [c.case_id for c in dyn]
    assert len(ids) == len(set(ids)) and [(c.method, c.inject) for c in dyn if c.inject] == [
        ("eagle_dynamic_k", STALE_K)
    ]


def test_stale_k_asked_for_without_a_dynamic_k_method_is_refused(tmp_path):
    from tests.commands import refused_in

    prefix = write_fake_vllm(tmp_path / "good", "0.34.0", "good")
    args = ["gate", "--no-installed", "--vllm", f"x={prefix}", "--methods", "eagle", "--self-control-forms", "stale-k"]
    refused_in(args, tmp_path, 2, "--self-control-forms stale-k would be ignored")
