"""A report says why: the first line of every CANNOT VOUCH names its cause in the user's words (the platform computes
wrong, the reference is untrusted, a hook did not fire, a CUDA error ...) and where; an error excerpt is the error's
own whole line (not CUDA's advice after it, never cut mid-word). Stand-in gate runs (no GPU) and the output an H100
case process left under MPS at 56 SMs (a device assert in a batch of MPS clients)."""

from __future__ import annotations

from repro.case.spec import UNTRUSTED_REFERENCE, CaseResult, CaseSpec, SmConfig
from repro.contract.verdicts import CANNOT_VOUCH, CLEAN, ERROR
from repro.judge.classify import classify
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import report
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

DEVICE_ASSERT = """\
  File "/venv/lib/python3.11/site-packages/vllm/v1/worker/gpu_model_runner.py", line 2210, in execute_model
    valid_sampled_token_ids = sampled_token_ids.tolist()
torch.AcceleratorError: CUDA error: device-side assert triggered
Search for `cudaErrorAssert' in https://docs.nvidia.com/cuda/cuda-runtime-api/group__CUDART__TYPES.html for more information.
CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace below might be incorrect.
For debugging consider passing CUDA_LAUNCH_BLOCKING=1
Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.
"""


def test_an_error_excerpt_is_the_errors_own_whole_line():
    spec = CaseSpec("vllm", "stale", "eager", sm=SmConfig("mps", 56), timeout_s=90)
    r = classify(spec, "a line before\n" + DEVICE_ASSERT, 1, False, None, 7.0)
    assert r.verdict == ERROR
    assert "torch.AcceleratorError: CUDA error: device-side assert triggered" in r.reason, r.reason
    assert "chronously" not in r.reason and "https://" not in r.reason  # CUDA's advice is not the error


def test_a_long_excerpt_is_cut_at_a_word_never_in_one():
    from repro.judge.excerpt import error_line

    said = error_line("RuntimeError: " + " ".join(f"word{i}" for i in range(200)), 120)
    assert len(said) <= 120 and said.endswith("…") and said[:-1].split()[-1].startswith("word")
    assert all(w == "RuntimeError:" or w.startswith("word") and w[4:].isdigit() for w in said[:-1].split())


def _stand_in_run(monkeypatch, tmp_path, modes: str, answer) -> gate_run.GateRun:
    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        return answer(case), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    monkeypatch.setattr(gate_run, "validate", lambda case, res, out: res)  # a stand-in reference is its answer
    build = VllmBuild("0.34.0", str(tmp_path), UNDER_TEST, "0.34.0")
    return gate_run.run_gate([build], parse_modes(modes), tmp_path / "logs", jobs=2, self_control="none")


def _headline(run: gate_run.GateRun) -> str:
    return next(ln for ln in report.markdown(run, terminal=True).splitlines() if ln.startswith("**Gate: "))


def test_cannot_vouch_names_an_untrusted_reference_and_where(monkeypatch, tmp_path):
    def answer(case):
        if case.reference and case.mode.sm.kind == "sm_margin":
            why = "reference not trusted: draft acceptance 7% without CUDA graphs"  # as its validation says it
            return CaseResult(case.case_id, ERROR, why, flags=[UNTRUSTED_REFERENCE])
        if case.mode.sm.kind == "sm_margin":
            return classify(case, DEVICE_ASSERT, 1, False, None, 7.0)  # the one classifier flags its CUDA error
        return CaseResult(case.case_id, CLEAN, "stand-in")

    line = _headline(_stand_in_run(monkeypatch, tmp_path, "plain,sm_margin:88", answer))
    assert line.startswith("**Gate: CANNOT VOUCH** because: "), line
    assert "the reference is untrusted at sm_margin:88" in line and "the platform there may compute wrong" in line, line
    assert "a CUDA error at sm_margin:88 (1 case(s))" in line, line


def test_cannot_vouch_names_a_hook_that_did_not_fire(monkeypatch, tmp_path):
    def answer(case):
        if not case.reference:
            return CaseResult(case.case_id, CANNOT_VOUCH, "the auditor's hook reported no capture")
        return CaseResult(case.case_id, CLEAN, "stand-in")

    line = _headline(_stand_in_run(monkeypatch, tmp_path, "audit", answer))
    assert line.startswith("**Gate: CANNOT VOUCH** because: a hook did not fire"), line
