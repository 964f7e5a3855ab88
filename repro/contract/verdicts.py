"""The verdict taxonomy: every verdict a case can get and the evidence it rests on. How a case process's output
becomes one: repro.judge.classify.

| verdict | evidence it rests on |
|---|---|
| oob | a compute-sanitizer memcheck finding (the kernel named from the report) |
| crash | a CUDA memory-fault code in the process output (illegal address / instruction, misaligned address, unspecified
  launch failure); the kernel when the output names it |
| launch-failure | a kernel launch that failed (CUTLASS "Error Internal", invalid configuration, too many resources);
  the kernel named from the failing launch check |
| hang | no exit within the case timeout and no memcheck finding: a hang is its own class, never a memory fault |
| wrong-output | the case ran, its output differs from the reference beyond the tolerance (the error is measured) |
| stale-audit | the case ran clean, but the metadata audit saw another batch's metadata |
| cannot-vouch | the case ran, but what it exists to exercise did not fire (zero audit checks, a hook never called,
  another attention backend, no FULL graphs, no speculative decoding): neither clean nor detection |
| error | the harness could not run the case as asked; never counted as clean or as detection |
| skip | the machine cannot provide what the case needs |

Which verdict meets which control, and what a gate run needs from its controls: repro.judge.policy."""

from __future__ import annotations

from enum import Enum


class StrValue(str, Enum):
    """A str enum whose members equal, hash and print as their value: Verdict here, repro.judge.decision.GateOutcome."""

    __str__ = str.__str__
    __format__ = str.__format__
    __repr__ = str.__repr__
    __hash__ = str.__hash__


class Verdict(StrValue):
    """A verdict: a str that equals, hashes, prints and pickles as its value ("clean"), so records, JSON and the
    verdict strings read back from results.json compare with it unchanged; the one place a verdict's name is
    written."""

    CLEAN = "clean"
    OOB = "oob"
    CRASH = "crash"
    LAUNCH_FAIL = "launch-failure"
    HANG = "hang"
    WRONG = "wrong-output"
    STALE_AUDIT = "stale-audit"
    CANNOT_VOUCH = "cannot-vouch"
    ERROR = "error"
    SKIP = "skip"


CLEAN = Verdict.CLEAN
OOB = Verdict.OOB
CRASH = Verdict.CRASH
LAUNCH_FAIL = Verdict.LAUNCH_FAIL
HANG = Verdict.HANG
WRONG = Verdict.WRONG
STALE_AUDIT = Verdict.STALE_AUDIT
CANNOT_VOUCH = Verdict.CANNOT_VOUCH
ERROR = Verdict.ERROR
SKIP = Verdict.SKIP
VERDICTS = tuple(Verdict)  # in the order above: the order of every report
MEMORY_FAULTS = (OOB, CRASH)
KERNEL_EVIDENCE = (OOB, CRASH, LAUNCH_FAIL, HANG, WRONG)
FAULTS = (*KERNEL_EVIDENCE, STALE_AUDIT)  # "the bug is visible", by any evidence
# the static source check's verdicts on a vLLM tree (repro.vllm_integration.releases.source_check), here below every
# layer that reads them: exit_codes decides a code from them without importing the releases layer
SOURCE_GOOD, SOURCE_BAD, SOURCE_UNTESTABLE = "good", "bad", "untestable"
SOURCE_NO_KNOWN_BAD = "no-known-bad-pattern"  # sources with no known bad pattern that no GPU record vouches for
EVIDENCE = {
    OOB: "memcheck finding",
    CRASH: "CUDA memory fault",
    LAUNCH_FAIL: "failed kernel launch",
    HANG: "timeout",
    WRONG: "output vs reference",
    STALE_AUDIT: "audit only",
    CANNOT_VOUCH: "none (the checked feature did not fire)",
    CLEAN: "output = reference",
    ERROR: "none (harness error)",
    SKIP: "none (did not run)",
}
