"""`python -m repro matrix --backend model`: the default matrix predicted on the CPU, no GPU needed.

The builder runs the V2 capture sequence over buffers filled by the scheduler model; every draft eager warmup is
predicted by the reads model. Entries FA3 never writes hold the poison value, or 0 when no poison is given (an
assumption: on a GPU they hold whatever the allocation held)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, replace

from repro.attention.builder import MetadataBuilder
from repro.attention.staleness import add_counts, diff_snapshots, summarize
from repro.backends.base import BackendIdentity
from repro.backends.layout import UPSTREAM, VLLM
from repro.backends.scheduler_inputs import SchedulerInputs
from repro.case.descriptors import AttnConfig
from repro.case.poison import DEFAULT_POISON, parse_poison
from repro.case.scenarios import FRESH, STALE, WARMUP, v2_capture_sequence
from repro.case.spec import CaseResult, CaseSpec, SmConfig
from repro.contract.verdicts import CLEAN, OOB, WRONG
from repro.errors import ConfigError
from repro.fa3_model.reads import Prediction, predict_launch
from repro.fa3_model.scheduler import PAD, host_plan, scheduler_metadata
from repro.fa3_model.scope import H200_SMS, MODEL_SM_KINDS

MODEL_SMS = (16, 26, 32, 60, 132)
# The evidence column of a predicted row: what the model predicts, never a measurement (`oob` on a GPU is a memcheck
# finding; here it is a read the model predicts goes out of bounds, with or without --sanitizer).
MODEL_EVIDENCE = {
    OOB: "CPU model: out-of-bounds read predicted",
    WRONG: "CPU model: wrong output predicted",
    CLEAN: "CPU model: clean run predicted",
}


class ModelBackend:
    """Scheduler metadata from repro.fa3_model.scheduler on CPU tensors; no forward."""

    def __init__(self, flavor: str, pad_value: int = 0, num_sms: int = H200_SMS) -> None:
        self.flavor, self.name, self.pad_value, self.num_sms = flavor, f"model-{flavor}", pad_value, num_sms

    def identity(self) -> BackendIdentity:
        return BackendIdentity(self.name, "repro.fa3_model", "1", "-", "-")

    def inputs(self, **call) -> SchedulerInputs:
        return SchedulerInputs.from_call(self.flavor, self.num_sms, **call)

    def scheduler_metadata(self, **kw):
        import torch  # torch only when the builder asks for a tensor: importing the model needs none

        buf, _ = scheduler_metadata(self.inputs(**kw))
        return torch.tensor([self.pad_value if v is PAD else v for v in buf], dtype=torch.int32)


@dataclass
class ModelCase:
    backend: str
    strategy: str
    sms: int
    splits: int
    poison: str | None
    prediction: Prediction
    descriptor: str | None

    @property
    def case_id(self) -> str:

        sm = SmConfig("full") if self.sms == H200_SMS else SmConfig("sm_margin", self.sms)
        return CaseSpec(
            self.backend, self.strategy, sm=sm, cfg=AttnConfig(num_splits=self.splits), poison=self.poison
        ).case_id


def predict_case(
    flavor: str, strategy: str, sms: int, cfg: AttnConfig, poison: str | None, sanitizer: bool = True
) -> tuple[Prediction, str | None]:
    """Predict the draft's eager warmups of the V2 sequence; the first faulting descriptor decides."""
    p = parse_poison(poison)
    backend = ModelBackend(flavor, p.value if p else 0)
    margin = H200_SMS - sms
    builder = MetadataBuilder(backend, cfg, sm_margin=margin, poison=p)
    shadow = MetadataBuilder(backend, cfg, sm_margin=margin, poison=p)
    worst: tuple[Prediction, str | None] = (Prediction(CLEAN), None)
    rank = {CLEAN: 0, WRONG: 1, OOB: 2}
    fields: dict[str, int] = {}
    passes = 0
    for ps in v2_capture_sequence(builder, strategy):
        if ps.stage != WARMUP:
            continue
        d, md = ps.descriptor, ps.metadata
        fresh = shadow.build(d)
        seen = md.snapshot()
        diffs = diff_snapshots(md, seen, fresh.snapshot())
        stale = len(diffs)
        add_counts(fields, summarize(diffs))
        passes += 1
        launch = host_plan(backend.inputs(**fresh.request))  # the S the launch allocates for
        pred = predict_launch(
            seen["scheduler_metadata"],
            md.layout,
            launch.num_splits,
            cfg.num_heads_q,
            cfg.head_dim,
            d.num_tokens,
            seen["query_start_loc"],
            stale,
            sanitizer,
        )
        if rank[pred.verdict] > rank[worst[0].verdict]:
            worst = (pred, d.label)
            if pred.verdict == OOB:
                break  # the process would have died here
    pred, desc = worst
    if desc is None:  # every eager warmup predicted clean: say what that rests on
        pred = Prediction(CLEAN, reason=_clean_reason(strategy, passes, fields))
    return replace(pred, stale_fields=fields), desc


def _clean_reason(strategy: str, passes: int, fields: dict[str, int]) -> str:
    if not passes:
        return "no eager warmup pass in this sequence"
    if strategy == FRESH and not fields:
        return (
            f"the fresh strategy builds metadata for every pass, so none of the {passes} eager warmups runs on stale "
            "metadata"
        )
    return f"all {passes} eager warmups run on metadata that reads in bounds and gives the reference output"


def predict_matrix(
    backends=("upstream", "vllm"),
    strategies=(STALE, FRESH),
    sms=MODEL_SMS,
    splits=(32, 0),
    poison: str | None = DEFAULT_POISON,
    cfg: AttnConfig | None = None,
) -> tuple[list[ModelCase], float]:
    cfg = cfg or AttnConfig()
    flavors = {"upstream": UPSTREAM, "vllm": VLLM}
    t0 = time.perf_counter()
    out = []
    for b in backends:
        for st in strategies:
            for n in sms:
                for s in splits:
                    pred, desc = predict_case(flavors[b], st, n, cfg.with_(num_splits=s), poison)
                    out.append(ModelCase(b, st, n, s, poison, pred, desc))
    return out, time.perf_counter() - t0


def markdown(cases: list[ModelCase], seconds: float, poison: str | None) -> str:
    lines = [
        f"# Predicted verdicts (CPU model, poison {poison or 'none: never-written entries assumed 0'})",
        "",
        f"{len(cases)} cases predicted in {seconds:.2f} s on one CPU core.",
        "",
        "| backend | strategy | SMs | splits | predicted | kernel | descriptor | why |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        p = c.prediction
        lines.append(
            f"| {c.backend} | {c.strategy} | {c.sms} | {c.splits} | **{p.verdict}** | {p.kernel or '-'} | "
            f"{c.descriptor or '-'} | {p.reason[:140]} |"
        )
    return "\n".join(lines) + "\n"


# What never-written entries may hold when nothing fills them: the recorded fixtures show leftovers of earlier builds
# (small split and block counts), freshly allocated memory can hold anything; these stand for that range.
UNKNOWN_PADDING = ("0", "-1", "1", "2", "8", "33", "1048576", "int-max", "int-min")


def predict_outcomes(
    flavor: str, strategy: str, sms: int, cfg: AttnConfig, poison: str | None, sanitizer: bool = True
) -> tuple[str, ...]:
    """The verdicts the model cannot rule out. With a poison the padding is known and there is one; without, the
    padding is unknown and every candidate in UNKNOWN_PADDING is tried."""
    fills = (poison,) if poison is not None else UNKNOWN_PADDING
    return tuple(sorted({predict_case(flavor, strategy, sms, cfg, f, sanitizer)[0].verdict for f in fills}))


def model_sms(spec) -> int:
    """The SM count FA3 plans for in a case the model can predict (ConfigError for the others)."""

    if spec.sm.kind not in MODEL_SM_KINDS:
        raise ConfigError(
            f"the CPU model predicts {', '.join(MODEL_SM_KINDS)} SM configurations, not {spec.sm.kind!r}: "
            "run that case on a GPU"
        )
    return spec.sm.sms or H200_SMS


def predict_specs(specs) -> list:
    """[(spec, CaseResult)] for eager v2-capture cases: the same result schema as a GPU run, verdicts predicted."""

    flavors = {"upstream": UPSTREAM, "vllm": VLLM}
    out = []
    for s in specs:
        t0 = time.perf_counter()
        pred, desc = predict_case(flavors[s.backend], s.strategy, model_sms(s), s.cfg, s.poison, s.sanitizer)
        reason = f"predicted: {pred.reason}"
        if s.poison is None:
            outcomes = predict_outcomes(flavors[s.backend], s.strategy, model_sms(s), s.cfg, None, s.sanitizer)
            reason = f"never-written entries assumed 0; with unknown padding any of {', '.join(outcomes)}. " + reason
        res = CaseResult(
            s.case_id,
            pred.verdict,
            reason,
            kernel=pred.kernel,
            descriptor=desc,
            sms_planned=model_sms(s),
            wall_s=round(time.perf_counter() - t0, 3),
            spec=json.loads(s.to_json()),
            evidence=MODEL_EVIDENCE[pred.verdict],
            stale_fields=dict(pred.stale_fields),
        )
        out.append((s, res))
    return out
