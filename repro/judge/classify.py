"""How a case process's output becomes a verdict (the taxonomy: repro.contract.verdicts): its records (the structured channel,
repro.contract.channel), its exit status, the clock and compute-sanitizer's findings, read once into a CaseResult with its
evidence. Later steps (the vLLM gate's reference comparison, attribution rerun, coverage check) never edit that record:
they make a new one that says what changed it (repro.case.spec.revise).

This is the one classifier of a case process's free-form output, the only code that reads a driver's or library's
message: a fault, a failed launch or out of memory (FAULT_MARKERS, LAUNCH_MARKERS, OOM_MARKERS: the kernel the line
names), a CUDA error in the line it quotes (CUDA_MARKERS: a typed flag, CUDA_ERROR), the MPS server's refusal
of a new client (REFUSAL_MARKERS: a typed flag, REFUSED), the words that say a
case's work had begun before its timeout (its spec's begun_marker, vLLM's captures: a typed flag, CAPTURING), and the
last lines of a process that exited without a result. Every later step decides by the typed record it makes, never by those words."""

from __future__ import annotations

import json
import re

from repro.attention.staleness import add_counts
from repro.case.spec import CAPTURING, CUDA_ERROR, CaseResult
from repro.case.spec import REFUSED as REFUSED_FLAG
from repro.contract.channel import Channel
from repro.contract.tags import DEVICE_TAG, FIRST_STALE, PASS_TAG, RESULT_TAG, SKIP_TAG
from repro.contract.verdicts import CLEAN, CRASH, ERROR, EVIDENCE, HANG, LAUNCH_FAIL, OOB, SKIP, STALE_AUDIT, WRONG
from repro.judge.excerpt import error_line
from repro.judge.memcheck_log import parse_log

FAULT_MARKERS = (  # the CUDA error codes of a kernel's bad memory access; a bare "CUDA error" is not one
    "illegal memory access",
    "an illegal instruction",
    "misaligned address",
    "unspecified launch failure",
    "operation not supported on global/shared address space",  # cudaErrorInvalidAddressSpace, seen on the H200
    "hardware stack error",
    "cudaErrorIllegalAddress",
    "cudaErrorLaunchFailure",  # its text is "unspecified launch failure": a kernel died while running
    "cudaErrorInvalidAddressSpace",
    "cudaErrorMisalignedAddress",
    "CUDA_ERROR_ILLEGAL_ADDRESS",
    "CUDA_ERROR_ILLEGAL_INSTRUCTION",
    "CUDA_ERROR_MISALIGNED_ADDRESS",
    "CUDA_ERROR_LAUNCH_FAILED",
    "CUDA_ERROR_HARDWARE_STACK_ERROR",
    "cudaErrorIllegalInstruction",
    "cudaErrorHardwareStackError",
    # an earlier kernel's asynchronous fault reported by the next library call that synchronizes: the libraries' own
    # words for "a GPU program failed to execute" (seen: cuBLAS after a stale draft forward under inductor)
    "CUBLAS_STATUS_EXECUTION_FAILED",
    "CUDNN_STATUS_EXECUTION_FAILED",
    "CUSPARSE_STATUS_EXECUTION_FAILED",
    "CUSOLVER_STATUS_EXECUTION_FAILED",
    "CUFFT_EXEC_FAILED",
    "CURAND_STATUS_LAUNCH_FAILURE",
)
# a fault or launch line is quoted whole in the reason (a cuBLAS call's line runs past 300 characters); this bound only
# keeps a runaway line (a tensor printed on one line) out of the report
QUOTE_MAX = 2000
LAUNCH_MARKERS = (
    "Error Internal",
    "invalid configuration argument",
    "too many resources requested for launch",
    "invalid device function",
)

# GPU memory the process could not get: an error about the machine, never about the build. Read where the process
# died (the end of its output: torch's exception), or, for memcheck:own, memcheck's log of the failed cudaMalloc
# together with torch's answer to the NULL that allocator then returned; a failure torch recovered from earlier
# (its caching allocator frees and retries) names nothing.
OOM_MARKERS = ("CUDA out of memory", "torch.OutOfMemoryError")
OOM_MEMCHECK = ('due to "out of memory" on CUDA API call to cudaMalloc', "but its data is not allocated yet")
OOM_TAIL_LINES = 40
OUT_OF_MEMORY = "the GPU ran out of memory (processes beside this one held it?)"


def out_of_memory(lines: list[str], sanitizer_log: str | None) -> str | None:
    """The line saying the process died for want of GPU memory (OOM_MARKERS, OOM_MEMCHECK), or None."""
    tail = lines[-OOM_TAIL_LINES:]
    if found := next((ln for ln in tail if any(m in ln for m in OOM_MARKERS)), None):
        return found
    in_log = next((ln for ln in (sanitizer_log or "").splitlines() if OOM_MEMCHECK[0] in ln), None)
    return in_log if in_log and any(OOM_MEMCHECK[1] in ln for ln in tail) else None


def kernel_in(text: str) -> str | None:
    """combine or main, when ONE line (the faulting line, a launch check, a memcheck header) names FA3's kernel or its
    launch template; never a whole log (a log names both kernels in unrelated lines)."""
    if re.search(r"combine", text, re.I):
        return "combine"
    if re.search(r"flash_fwd_launch|FlashAttnFwdSm|flash_fwd", text):
        return "main"
    return None


# A CUDA runtime error in the line a reason quotes (a fault, a failed launch, the error a process without a result
# ended on): torch's "CUDA error: ...", a device-side assert and the assertion it printed. A typed flag (CUDA_ERROR),
# so that no later step (the gate's why) reads these words.
CUDA_MARKERS = ("CUDA error", "device-side assert", "Assertion")

# How a process the GPU would not take is reported: under MPS, the server refuses new clients while it recovers from
# a client's fault (NVIDIA's MPS guide, "error containment").
REFUSED = "the GPU refused this process (busy or unavailable)"
REFUSAL_MARKERS = ("busy or unavailable",)  # CUDA's words for a device it would not give this process


def refused(res: CaseResult) -> bool:
    """Did the case never run because the GPU (an MPS server still recovering) refused its process?"""
    return res.verdict == ERROR and REFUSED_FLAG in res.flags


def classify(
    spec,
    output: str,
    returncode: int | None,
    timed_out: bool,
    sanitizer_log: str | None,
    wall_s: float,
    channel: Channel | None = None,
):
    """Turn what a case process left behind into a verdict with its evidence, once: its records (the structured
    channel, repro.contract.channel; for a log recorded before the channel, the tagged lines of its output), its exit, the
    clock and memcheck's findings. The free-form output is read for one thing only: the line a fault or a failed
    launch was reported on (and the kernel that line names), a refusal, the words saying its work had begun
    (`begun_marker`) before a timeout, and its last lines. Pure: the CPU tier tests it on recorded outputs.
    `spec` needs case_id, timeout_s, begun_marker and to_json() (CaseSpec, the vLLM gate's GateCase)."""
    ch = channel if channel is not None else Channel.from_output(output)
    passes, results, skips = ch.of(PASS_TAG), ch.of(RESULT_TAG), ch.of(SKIP_TAG)
    last = passes[-1]["descriptor"] if passes else None
    findings = parse_log(sanitizer_log).findings if sanitizer_log else []
    tail = "\n".join(output.strip().splitlines()[-15:])
    res = CaseResult(spec.case_id, ERROR, "", returncode=returncode, wall_s=round(wall_s, 2), log_tail=tail)
    res.spec = json.loads(spec.to_json())
    if results:
        r = results[-1]
        res.stale_fields, res.first_diffs = r.get("stale_fields", {}), r.get("first_diffs", [])
        res.max_abs_err, res.sms_reported, res.sms_planned = (
            r.get("max_abs_err"),
            r.get("sms_reported"),
            r.get("sms_planned"),
        )
        res.backend_identity = r.get("backend_identity")
        res.phases = r.get("phases")
        res.tolerance = r.get("tolerance")
    elif passes:  # no result (crash, hang): what the launches so far were given
        for p in passes:
            add_counts(res.stale_fields, p.get("stale_fields", {}))
            res.first_diffs += [f"{p['descriptor']}: {x}" for x in p.get("first_diffs", [])][: 3 - len(res.first_diffs)]
    devices = ch.of(DEVICE_TAG)
    if devices:
        res.gpu_uuid = devices[-1].get("gpu_uuid")
        if res.phases is None:  # no result line (a crash, a hang): the start-up phases the process reported
            res.phases = devices[-1].get("phases")
    res.findings = [f.to_dict() for f in findings]
    during = f" (during {last})" if last else ""

    def done(verdict: str, reason: str, evidence: str, descriptor: str | None = None, line: str = "") -> CaseResult:
        """The record, with `line` (the output line its reason quotes) read for a CUDA error."""
        res.verdict, res.reason, res.descriptor = verdict, reason, descriptor
        if any(m in line for m in CUDA_MARKERS):
            res.flags.append(CUDA_ERROR)
        res.evidence = f"{EVIDENCE[verdict]}: {evidence}" if evidence else EVIDENCE[verdict]
        return res

    if skips and not results:
        return done(SKIP, skips[-1]["reason"], "")
    if findings:
        f = findings[0]
        res.kernel = f.role
        more = f" (+{len(findings) - 1} more groups)" if len(findings) > 1 else ""
        reason = f"memcheck: {f}{more}" + (f"; then no exit within {spec.timeout_s:g} s" if timed_out else "")
        return done(OOB, reason, f"{f.role} kernel, {f.access}", None if results else last)
    if timed_out:
        if spec.begun_marker and spec.begun_marker in output:  # stopped after its work began (vLLM: its captures)
            res.flags.append(CAPTURING)
        return done(HANG, f"no exit within {spec.timeout_s:g} s (last launch: {last})", f"{spec.timeout_s:g} s", last)
    if not results and any(m in output for m in REFUSAL_MARKERS):
        res.flags.append(REFUSED_FLAG)
        return done(ERROR, f"{REFUSED}: another client faulted it; rerun alone", "", last)
    if not results:
        lines = output.splitlines()
        fault = next((ln for ln in lines if any(m in ln for m in FAULT_MARKERS)), None)
        launch = next((ln for ln in lines if any(m in ln for m in LAUNCH_MARKERS)), None)
        if fault:
            res.kernel = kernel_in(fault)
            return done(CRASH, quoted(fault) + during, _marker(fault, FAULT_MARKERS), last, fault)
        if launch:
            res.kernel = kernel_in(launch)
            return done(LAUNCH_FAIL, quoted(launch) + during, _marker(launch, LAUNCH_MARKERS), last, launch)
        oom = out_of_memory(lines, sanitizer_log)
        if oom and (returncode or 0) != 0:
            return done(ERROR, f"{OUT_OF_MEMORY}: {oom.strip(' =')[:240]}", "", last, oom.strip(" =")[:240])
        if (returncode or 0) != 0:
            said = error_line(tail)
            return done(ERROR, f"exit status {returncode} without a result: {said}", "", last, said)
        return done(ERROR, "no result line", "", last)
    r = results[-1]
    if r.get("wrong"):
        err = r.get("max_abs_err")
        tol = r.get("tolerance")
        where = r.get("worst_descriptor")
        reason = f"max |out - reference| = {err:.3g} at {where}" + (f" (tolerance {tol:.3g})" if tol else "")
        return done(WRONG, reason, f"max error {err:.3g}", where)
    if res.stale_fields:
        reason = "no fault this run, but passes ran on another batch's metadata: " + ", ".join(
            f"{k}={v}" for k, v in sorted(res.stale_fields.items())
        )
        if r.get("summary"):  # what the kernels' outputs showed (spec-decode: graph against eager)
            reason += f"; outputs: {r['summary']}"
        return done(STALE_AUDIT, reason, "", r.get(FIRST_STALE))  # typed by the worker that found it
    if returncode not in (0, None):
        return done(ERROR, f"result printed but exit status {returncode}", "")
    if ch.problems:  # a record that could not be read: the result cannot be trusted to be whole
        return done(ERROR, "; ".join(ch.errors())[:300], "")
    if sanitizer_log is not None and parse_log(sanitizer_log).error_summary is None:  # "" : it wrote no log
        return done(ERROR, "memcheck ran but wrote no ERROR SUMMARY: its check did not finish, nothing is vouched", "")
    summary = r.get("summary") or (
        f"{r.get('passes')} passes, max |out - reference| = {r.get('max_abs_err', 0):.3g}"
        + (f" (tolerance {res.tolerance:.3g})" if res.tolerance else "")
    )
    return done(CLEAN, summary, "")


def quoted(line: str) -> str:
    """An output line as a reason quotes it: whole, stripped; only a line past QUOTE_MAX is cut, and says so."""
    line = line.strip()
    return line if len(line) <= QUOTE_MAX else line[:QUOTE_MAX] + f" [... {len(line) - QUOTE_MAX} more characters]"


def _marker(line: str, markers: tuple[str, ...]) -> str:
    return next(m for m in markers if m in line)
