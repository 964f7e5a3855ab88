"""A gate case in the audit mode is judged by the auditor's count whatever way its process ends, and a CUDA execution
failure reported through any library after an asynchronous fault is kernel evidence (a crash, its line quoted whole),
never an error without evidence.

Each case goes the whole way a live one goes: classify (the process's output, exit status and clock) -> annotate (the
steps of "its process ended") -> finish (the steps of "its reference known") -> the policy's answer for its
expectation. A self control must come out caught, a build under test AFFECTED (a fault of the policy's), and neither
may become an error that a HARNESS BLIND or a false PASS rests on."""

from __future__ import annotations

import json

import pytest

from repro.case.spec import CaseResult
from repro.contract.channel import Channel
from repro.contract.verdicts import CLEAN, CRASH, ERROR, FAULTS, HANG, STALE_AUDIT
from repro.judge import policy
from repro.judge.classify import QUOTE_MAX, classify
from repro.vllm_integration.gate import steps as gate_steps
from repro.vllm_integration.gate.case import GateCase, expected, reference_for
from repro.vllm_integration.gate.coverage import features_needed
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.plugin.audit import STALE_DESCRIPTOR
from repro.vllm_integration.plugin.inject import STALE_CAPTURE
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

BUILD = VllmBuild("0.34.0", None, UNDER_TEST, "0.34.0")

# the line the H100 run of `gate --methods all` under inductor died with, after the auditor counted 1544 stale fields
CUBLAS = (
    "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmEx( handle, opa, opb, m, n, k, "
    "&falpha, a, CUDA_R_16BF, lda, b, CUDA_R_16BF, ldb, &fbeta, c, CUDA_R_16BF, ldc, compute_type, "
    "CUBLAS_GEMM_DEFAULT_TENSOR_OP)`"
)
# every spelling of "a GPU program failed" that a library reports an earlier kernel's fault in
CUDA_ERROR_LINES = [
    CUBLAS,
    "RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED",
    "RuntimeError: CUDA error: unspecified launch failure",
    "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered",
    "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
    "misc.cc:94 NCCL WARN Cuda failure 700 'an illegal memory access was encountered'",
    "RuntimeError: CUDA driver error: CUDA_ERROR_LAUNCH_FAILED",
    "RuntimeError: CUDA error: misaligned address",
    "RuntimeError: cusparse error: CUSPARSE_STATUS_EXECUTION_FAILED",
    "RuntimeError: CUDA error: an illegal instruction was encountered",
]

STALE = {
    "descriptor": "FULL t138r23 q6",
    "buffer": "seq_lens",
    "field": "num_reqs",
    "index": 0,
    "built": 23,
    "now": 24,
    "kind": STALE_DESCRIPTOR,
}


def case(inject: bool) -> GateCase:
    return GateCase(BUILD, GateMode.parse("audit"), inject=STALE_CAPTURE if inject else None)


def records(c: GateCase, *, stale: int, summary: bool) -> list[str]:
    """What the case's process wrote on its channel before it ended: the plugin's features, the injection's own
    records (a self control), the auditor's stale views as it found them, and its summary when it got that far."""
    lines = [f"REPRO_PLUGIN {json.dumps({'installed': f})}" for f in sorted(features_needed(c))]
    lines.append('REPRO_DEVICE {"gpu": "NVIDIA H100 80GB HBM3", "sms": 132}')
    if c.inject:
        lines.append('REPRO_PLUGIN {"injection_wrote": "draft build"}')
    lines += [f"REPRO_AUDIT {json.dumps({'stale': STALE, 'message': 'stale'})}"] * stale
    if summary:
        lines.append(f"REPRO_AUDIT {json.dumps({'checks': 714, 'descriptor_checks': 148})}")
    return lines


# how a process can end after the auditor counted: (id, output lines after the records, exit status, timed out)
ENDINGS = [
    ("cublas-fault", ["Traceback (most recent call last):", CUBLAS], 1, False),
    ("cudnn-fault", ["RuntimeError: cuDNN error: CUDNN_STATUS_EXECUTION_FAILED"], 1, False),
    ("python-error", ["Traceback (most recent call last):", "ValueError: something else broke"], 1, False),
    ("killed", [], -9, False),
    ("exit-0-without-result", [], 0, False),
    ("out-of-memory", ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"], 1, False),
    ("hang-after-the-count", [], None, True),
]


def judged(c: GateCase, output: str, returncode: int | None, timed_out: bool) -> CaseResult:
    res = classify(c, output, returncode, timed_out, None, 12.5, Channel.from_output(output))
    res = gate_steps.annotate(res, c, output, None)
    ref = reference_for(c)
    ref_res = CaseResult(ref.case_id, CLEAN, "ran")
    return gate_steps.finish(c, res, None, ref_res, {"tokens": [[1, 2]], "margins": [[5.0, 5.0]]})


@pytest.mark.parametrize("summary", [True, False], ids=["summary-reported", "no-summary"])
@pytest.mark.parametrize("ending", ENDINGS, ids=[e[0] for e in ENDINGS])
def test_a_self_control_the_auditor_counted_is_caught_however_its_process_ends(ending, summary):
    _, tail, rc, timed_out = ending
    c = case(inject=True)
    got = judged(c, "\n".join(records(c, stale=3, summary=summary) + tail), rc, timed_out)
    assert got.verdict in FAULTS, (got.verdict, got.reason)
    assert policy.problem(expected(c), got.verdict) is None, (got.verdict, got.reason)
    assert got.stale_fields  # the count that decided it stays on the record


@pytest.mark.parametrize("ending", ENDINGS, ids=[e[0] for e in ENDINGS])
def test_a_build_the_auditor_counted_stale_is_affected_however_its_process_ends(ending):
    _, tail, rc, timed_out = ending
    c = case(inject=False)
    got = judged(c, "\n".join(records(c, stale=2, summary=False) + tail), rc, timed_out)
    assert got.verdict in FAULTS and policy.problem(expected(c), got.verdict) is not None, (got.verdict, got.reason)


def test_a_process_that_ended_without_a_result_says_how_beside_the_count():
    c = case(inject=True)
    out = "\n".join(records(c, stale=1, summary=True) + ["ValueError: something else broke"])
    got = judged(c, out, 1, False)
    assert got.verdict == STALE_AUDIT
    assert "exit status 1 without a result" in got.reason and "builder gives 23" in got.reason
    # no comparison or acceptance is asked of a process without tokens
    assert [h["step"] for h in got.history] == ["audit"]


@pytest.mark.parametrize("line", CUDA_ERROR_LINES)
def test_a_cuda_error_reported_through_any_library_is_a_crash_quoted_whole(line):
    c = case(inject=False)
    out = "\n".join(['REPRO_PASS {"descriptor": "FULL t4r4"}', "some log line", line, "further output"])
    res = classify(c, out, 1, False, None, 3.0, Channel.from_output(out))
    assert res.verdict == CRASH, res.reason
    assert res.reason.startswith(line.strip()), res.reason  # the CUDA error's own line, never cut


def test_a_crash_before_any_count_is_classified_like_any_other():
    c = case(inject=True)
    got = judged(c, "\n".join(records(c, stale=0, summary=False) + [CUBLAS]), 1, False)
    assert got.verdict not in (STALE_AUDIT, CLEAN)  # kernel evidence, yet the auditor caught nothing: not its count
    assert got.verdict != ERROR or "exit status" not in got.reason


def test_an_error_without_any_count_stays_an_error():
    c = case(inject=False)
    got = judged(c, "\n".join(records(c, stale=0, summary=False) + ["ValueError: boom"]), 1, False)
    assert got.verdict == ERROR and got.reason.startswith("exit status 1 without a result")


def test_a_hang_with_a_count_is_not_a_hang_before_capture():
    c = case(inject=False)
    got = judged(c, "\n".join(records(c, stale=1, summary=False)), None, True)
    assert got.verdict == HANG and "auditor caught stale views" in got.reason, got.reason


def test_only_a_runaway_line_is_cut_and_says_so():
    c = case(inject=False)
    line = "RuntimeError: CUDA error: an illegal memory access was encountered " + "x" * (QUOTE_MAX + 50)
    res = classify(c, line, 1, False, None, 3.0, Channel.from_output(line))
    assert res.verdict == CRASH and res.reason.endswith("more characters]") and len(res.reason) < QUOTE_MAX + 100
