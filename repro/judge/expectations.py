"""What each attention-layer control must show (repro.judge.policy's expectations), computed ONCE per case before its
results are judged and stored in the result (CaseResult.expected): reports and gates read it from there, and old
records keep the expectation they were held to. `python -m repro agree` re-judges records against today's model."""

from __future__ import annotations

import functools

from repro.backends.layout import UPSTREAM, VLLM
from repro.case.descriptors import AttnConfig
from repro.case.scenarios import DEFAULT_PAIR, PAIR, V2
from repro.case.spec import CaseSpec, positive_control
from repro.contract.verdicts import OOB, WRONG
from repro.fa3_model.scope import H200_SMS, MODEL_SM_KINDS
from repro.judge.control import AUDIT, DETECTED, EXPECT_CLEAN, FAULT, GatingMode

# Where the CPU model cannot decide: what was measured on the H200 (results/), by (scenario or SM kind, poison).
MEASURED = {
    ("spec-decode", "int-max"): FAULT,  # results/h200-spec: stale crashed 4/4; launch failures: h200-launch-failures
    ("spec-decode", None): AUDIT,  # results/h200-spec-nopoison: stale-audit 4/4, tokens equal
    ("pair", "int-max"): DETECTED,  # results/h200-pytest-gpu: the pair case (DEFAULT_PAIR, t4r1 -> t32r8) was caught
    ("green", None): DETECTED,  # results/h200-green: stale wrong-output at 16 SMs
}
# Case features the CPU model does not model, each with why: under them its verdict would be a guess, and so would
# every row of MEASURED (all measured without them). Such a stale case expects `audit` (repro.judge.policy.AUDIT_CONTROLS,
# "unmeasured"); `matrix --model` refuses to predict it and `agree` leaves it out.
UNMODELLED = (
    (
        "sliding window",
        lambda spec: spec.cfg.is_local,
        "the reads model does not model which metadata FA3's local (sliding-window) kernels read: on the H200, "
        "stale --window 128 and 256 cases with splits 0 gave wrong-output where it predicted a fault",
    ),
)


@functools.lru_cache(maxsize=4096)
def _model_outcomes(
    backend: str, strategy: str, sms: int, cfg: AttnConfig, poison: str | None, sanitizer: bool
) -> tuple[str, ...]:
    from repro.fa3_model.predict import predict_outcomes  # here: the CPU model imports this module (and numpy)

    return predict_outcomes({"upstream": UPSTREAM, "vllm": VLLM}[backend], strategy, sms, cfg, poison, sanitizer)


def unmodelled(spec: CaseSpec) -> list[str]:
    """The features of this case the CPU model does not model (UNMODELLED), each as `name: why`; [] when none."""
    return [f"{name}: {why}" for name, applies, why in UNMODELLED if applies(spec)]


def expectation(spec: CaseSpec) -> str:
    """`clean` for fresh metadata; for stale, from the CPU model where it decides (v2-capture cases at sm_margin, MPS
    or the whole GPU, without a feature it does not model), over every padding it cannot rule out: only
    out-of-bounds reads -> `fault` (eager) or `detected` (graph), only reads or wrong output -> `detected`, a clean
    outcome possible -> `audit` (repro.judge.policy.AUDIT_CONTROLS lists why). A feature the model does not model
    (UNMODELLED) -> `audit`; elsewhere from MEASURED (a pair case: only for the descriptor pair it measured), else
    `audit`: no claim the GPU did not back."""
    if not positive_control(spec):
        return EXPECT_CLEAN
    if unmodelled(spec):  # neither the model nor any measurement covers it: no guess
        return AUDIT
    if spec.scenario == V2 and spec.sm.kind in MODEL_SM_KINDS:
        outcomes = set(
            _model_outcomes(spec.backend, spec.strategy, spec.sm.sms or H200_SMS, spec.cfg, spec.poison, spec.sanitizer)
        )
        if outcomes == {OOB}:
            return FAULT if spec.mode == "eager" else DETECTED
        return DETECTED if outcomes <= {OOB, WRONG} else AUDIT
    if spec.scenario == PAIR and tuple(spec.pair or ()) != DEFAULT_PAIR:
        return AUDIT  # MEASURED's pair row is the pair it measured: another (matrix --built-for/--launched) is not
    key = spec.scenario if spec.scenario != V2 else spec.sm.kind
    return MEASURED.get((key, spec.poison), AUDIT)


def gate_mode(spec: CaseSpec) -> GatingMode:
    """The gating mode a control belongs to (repro.judge.policy): its evidence channel; an attention-layer case's
    stale-audit is the harness's builder's, never the engine's (GatingMode.engine_audit)."""
    return GatingMode("memcheck" if spec.sanitizer else spec.mode)
