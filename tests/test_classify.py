"""Verdicts from what case processes left behind on the H200 (recorded outputs and memcheck logs)."""

import json
from pathlib import Path

import pytest

from repro.case.descriptors import AttnConfig
from repro.case.spec import CaseSpec, SmConfig
from repro.contract.verdicts import CLEAN, CRASH, ERROR, HANG, LAUNCH_FAIL, OOB, SKIP, WRONG
from repro.judge.classify import classify
from tests.records import RESULTS

SPEC = CaseSpec("vllm", "stale", "eager", sm=SmConfig("sm_margin", 16), poison="int-max", timeout_s=90)


def _out(fixtures, name):
    return (fixtures / "outputs" / name).read_text()


def test_crash_names_descriptor_and_stale_fields(fixtures):
    r = classify(SPEC, _out(fixtures, "crash-vllm-16sm-intmax.out.log"), 1, False, None, 7.6)
    assert r.verdict == CRASH and r.descriptor == "t32r8"
    assert "during t32r8" in r.reason
    assert r.stale_fields["query_start_loc"] > 0 and r.first_diffs


def test_clean(fixtures):
    r = classify(SPEC, _out(fixtures, "clean-vllm-16sm.out.log"), 0, False, None, 6.0)
    assert r.verdict == CLEAN and r.sms_planned == 16 and r.sms_reported == 132
    assert r.backend_identity["version"] == "0.25.1"


def test_wrong_output_is_silent_garbage(fixtures):
    r = classify(SPEC, _out(fixtures, "wrong-vllm-132sm.out.log"), 0, False, None, 6.0)
    assert r.verdict == WRONG and r.max_abs_err > 0.05 and r.descriptor


def test_oob_from_memcheck_log_names_the_combine_kernel(fixtures):
    spec = CaseSpec(
        "upstream", "stale", "eager", sm=SmConfig("sm_margin", 16), cfg=AttnConfig(num_splits=0), sanitizer=True
    )
    log = (fixtures / "memcheck" / "combine-oob-upstream-16sm-nopoison.log").read_text()
    r = classify(spec, _out(fixtures, "oob-combine-upstream.out.log"), -9, False, log, 9.0)
    assert r.verdict == OOB and r.kernel == "combine" and r.descriptor == "t64r16"
    assert "FlashAttnFwdCombine" in r.reason


def test_findings_win_over_timeout(fixtures):
    log = (fixtures / "memcheck" / "main-oob-vllm-16sm-intmax.log").read_text()
    r = classify(SPEC, 'REPRO_PASS {"descriptor": "t32r8"}\n', -9, True, log, 90)
    assert r.verdict == OOB and r.kernel == "main" and "no exit within" in r.reason


def test_hang_without_findings():
    r = classify(SPEC, 'REPRO_PASS {"descriptor": "t48r12", "stale_fields": {"seq_lens": 3}}\n', -9, True, None, 90)
    assert r.verdict == HANG and r.descriptor == "t48r12" and r.stale_fields == {"seq_lens": 3}


def test_mps_server_down_is_an_error_not_a_skip(fixtures):
    r = classify(SPEC, _out(fixtures, "error-mps-busy.out.log"), 1, False, None, 3.0)
    assert r.verdict == ERROR and "busy or unavailable" in r.reason


def test_skip_and_unknown_failure():
    assert classify(SPEC, 'REPRO_SKIP {"reason": "no GPU"}\n', 0, False, None, 1).verdict == SKIP
    r = classify(SPEC, "Traceback...\nValueError: boom\n", 1, False, None, 1)
    assert r.verdict == ERROR and "exit status 1" in r.reason


LAUNCH_SWEEP = RESULTS / "h200-launch-failures-2"
LAUNCH_LOGS = sorted(p for p in LAUNCH_SWEEP.glob("*/logs/*.out.log") if "CUTLASS error (" in p.read_text())


def _recorded(log: Path) -> dict:
    """The result results.json recorded for the case whose output `log` is."""
    case_id = log.name.removesuffix(".out.log")
    doc = json.loads((log.parent.parent / "results.json").read_text())
    return next(c["result"] for c in doc["cases"] if c["case"] == case_id)


def test_the_launch_sweep_printed_fa3_launch_errors():
    """results/h200-launch-failures-2: 32 stale cases whose process printed FA3's `CUTLASS error (%s:%d): %s`."""
    assert len(LAUNCH_LOGS) == 32


@pytest.mark.parametrize("log", LAUNCH_LOGS, ids=lambda p: f"{p.parent.parent.name}-{p.name[15:-8]}")
def test_launch_failure_is_detection_with_the_kernel_not_an_error(log):
    """A kernel launch that failed on stale metadata (the line FA3 printed on the H200, from the combine's launch check)
    is evidence from the kernel, not a harness error: its combine kernel named from that line, its descriptor the last
    one the process announced before it, as recorded."""
    out = log.read_text()
    rec = _recorded(log)
    spec = CaseSpec.from_json(json.dumps(rec["spec"]))
    r = classify(spec, out, rec["returncode"], False, None, rec["wall_s"])
    line = next(ln for ln in out.splitlines() if ln.startswith("CUTLASS error ("))
    last_pass = [json.loads(ln.split(" ", 1)[1]) for ln in out.splitlines() if ln.startswith("REPRO_PASS ")][-1]
    assert r.verdict == LAUNCH_FAIL == rec["verdict"] and rec["returncode"] != 0
    assert r.kernel == "combine" and "combine" in line  # the launch template FA3 named
    assert r.descriptor == last_pass["descriptor"] == rec["descriptor"]
    assert r.evidence == f"failed kernel launch: {line.rsplit('): ', 1)[1]}" == rec["evidence"]
    assert r.reason.startswith(line)
    # without that line the same process is no kernel evidence at all: an error of the harness
    rest = "\n".join(ln for ln in out.splitlines() if not ln.startswith("CUTLASS error ("))
    assert classify(spec, rest, rec["returncode"], False, None, rec["wall_s"]).verdict == ERROR


def test_a_bare_cuda_error_is_not_a_memory_fault():
    r = classify(SPEC, "torch.AcceleratorError: CUDA error: out of memory\n", 1, False, None, 2.0)
    assert r.verdict == ERROR


def test_every_verdict_says_what_it_rests_on(fixtures):
    r = classify(SPEC, _out(fixtures, "crash-vllm-16sm-intmax.out.log"), 1, False, None, 7.6)
    assert r.verdict == CRASH and r.evidence.startswith("CUDA memory fault: operation not supported")
    assert classify(SPEC, 'REPRO_PASS {"descriptor": "t8r2"}\n', -9, True, None, 90).evidence == "timeout: 90 s"


def test_the_tolerance_a_result_was_held_to_is_kept_and_shown():
    out = (
        'REPRO_RESULT {"passes": 9, "max_abs_err": 0.0092, "tolerance": 0.0157, "wrong": false, '
        '"stale_fields": {}, "first_diffs": []}\n'
    )
    r = classify(SPEC, out, 0, False, None, 1.0)
    assert r.verdict == CLEAN and r.tolerance == 0.0157 and "(tolerance 0.0157)" in r.reason
    assert r.to_dict()["tolerance"] == 0.0157


def test_a_client_refused_after_its_mps_neighbour_faulted(fixtures):
    """Recorded on the H200 (scripts/mps-neighbour-faults.py): stale memcheck cases as one batch of MPS clients; this
    one was refused the GPU before its first launch. An error with its start-up phases, never a verdict on the case,
    and not one repro.run.mps_cases keeps from a batch."""
    from repro.run.mps_cases import TRUSTED_IN_BATCH

    r = classify(SPEC, _out(fixtures, "mps-neighbour-busy-memcheck.out.log"), 1, False, None, 6.0)
    assert r.verdict == ERROR and "another client faulted it; rerun alone" in r.reason
    assert r.phases["import_s"] > 0 and r.gpu_uuid and r.verdict not in TRUSTED_IN_BATCH


def test_refusal_and_rerun_are_typed_flags_not_the_words_of_a_reason(fixtures):
    """A refused process is known by its flag (its reason says 'rerun alone' too: the words once counted it as an MPS
    rerun); a reason that merely reads like a refusal, or a stall, decides nothing."""
    from dataclasses import replace

    from repro.case.spec import REFUSED, RERUN_ALONE, STALLED, CaseResult
    from repro.judge.classify import REFUSED as REFUSED_TEXT
    from repro.judge.classify import refused

    r = classify(SPEC, _out(fixtures, "mps-neighbour-busy-memcheck.out.log"), 1, False, None, 6.0)
    assert r.flags == [REFUSED] and refused(r) and RERUN_ALONE not in r.flags
    assert not refused(replace(r, flags=[]))  # the same words without the flag: not a refusal
    worded = CaseResult("x", ERROR, f"{REFUSED_TEXT}: another client faulted it; rerun alone")
    assert not refused(worded) and STALLED not in worded.flags
    assert CaseResult.__dataclass_fields__["flags"].default_factory() == []  # a fresh record has none


def test_out_of_gpu_memory_is_read_where_the_process_died_only():
    """torch's exception at the end of the output, or memcheck's failed cudaMalloc with torch's answer to the NULL
    memcheck:own's allocator returned; an earlier failure torch recovered from (its caching allocator retries) is
    not the reason a later, unrelated error ends the process."""
    from repro.judge.classify import OOM_TAIL_LINES, out_of_memory

    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 30.00 MiB."
    assert out_of_memory(["engine start", oom], None) == oom
    recovered = [oom, *["decoding"] * OOM_TAIL_LINES, "ValueError: something else"]
    assert out_of_memory(recovered, None) is None
    malloc = '========= Program hit cudaErrorMemoryAllocation (error 2) due to "out of memory" on CUDA API call to cudaMalloc.'
    null = "RuntimeError: The tensor has a non-zero number of elements, but its data is not allocated yet."
    assert out_of_memory(["capture", null], malloc) == malloc
    assert out_of_memory(["capture", "ValueError: something else"], malloc) is None
