"""The model's predicted verdicts against the GPU's recorded verdicts on the same cases."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from repro.backends.layout import UPSTREAM, VLLM
from repro.case.descriptors import AttnConfig
from repro.contract.verdicts import CRASH, ERROR, HANG, OOB, SKIP
from repro.fa3_model.predict import predict_case, predict_outcomes
from repro.fa3_model.scope import H200_SMS
from repro.judge.expectations import unmodelled
from repro.report.results import MODEL, load_json


@dataclass
class Agreement:
    case_id: str
    gpu: str
    gpu_kernel: str | None
    gpu_descriptor: str | None
    model: str
    model_kernel: str | None
    model_descriptor: str | None
    model_outcomes: tuple[str, ...] = ()  # what the model cannot rule out (unknown padding: several)

    @property
    def verdict_agrees(self) -> bool:
        """The GPU's verdict is one the model could not rule out (a crash or hang counts as the predicted read)."""
        gpu = OOB if self.gpu in (OOB, CRASH, HANG) else self.gpu
        return gpu in (self.model_outcomes or (self.model,))

    @property
    def descriptor_agrees(self) -> bool | None:
        """The pass where the verdict arose is the same (None where the GPU named none: a clean run names none).
        Counted apart from the verdict: a crash at t48r12 and a predicted read at t64r16 are one verdict."""
        if not self.gpu_descriptor:
            return None
        return self.gpu_descriptor == self.model_descriptor

    @property
    def kernel_agrees(self) -> bool | None:
        if not self.gpu_kernel or self.gpu != OOB:
            return None
        return self.gpu_kernel == self.model_kernel


def compare(paths: list[str | Path]) -> list[Agreement]:
    """Every eager V2 case of the given runs whose SM count the model covers (sm_margin, MPS or the whole GPU) and
    whose features it models (repro.judge.expectations.UNMODELLED)."""
    out = []
    flavors = {"upstream": UPSTREAM, "vllm": VLLM}
    # one prediction per distinct case: the records repeat their cases (934 predictions over results/ were 336
    # distinct cases); AttnConfig is frozen, a key
    case, outcomes_of = functools.cache(predict_case), functools.cache(predict_outcomes)
    for path in paths:
        run = load_json(path)
        if run.source == MODEL:  # predictions: nothing measured to compare with
            continue
        for s, r in run.results:
            if s.mode != "eager" or s.scenario != "v2-capture" or s.sm.kind not in ("sm_margin", "mps", "full"):
                continue
            if unmodelled(s):  # a feature the model does not model (a sliding window): it makes no claim there
                continue
            if r.verdict in (SKIP, ERROR):  # the GPU gave no verdict to compare with
                continue
            sms = s.sm.sms or H200_SMS
            cfg = AttnConfig.from_dict({**s.cfg.to_dict()})
            pred, desc = case(flavors[s.backend], s.strategy, sms, cfg, s.poison, s.sanitizer)
            outcomes = outcomes_of(flavors[s.backend], s.strategy, sms, cfg, s.poison, s.sanitizer)
            out.append(
                Agreement(s.case_id, r.verdict, r.kernel, r.descriptor, pred.verdict, pred.kernel, desc, outcomes)
            )
    return out


def counts(rows: list[Agreement]) -> dict[str, tuple[int, int]]:
    """(agreeing, compared) for verdicts (every case), descriptors (cases where the GPU named one) and kernels
    (memcheck findings that named one): three numbers, never folded into one."""
    d = [r.descriptor_agrees for r in rows if r.descriptor_agrees is not None]
    k = [r.kernel_agrees for r in rows if r.kernel_agrees is not None]
    return {
        "verdict": (sum(r.verdict_agrees for r in rows), len(rows)),
        "descriptor": (sum(d), len(d)),
        "kernel": (sum(k), len(k)),
    }


def _mark(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def markdown(rows: list[Agreement], sources: list[str]) -> str:
    c = counts(rows)
    (v, n), (d, dn), (k, kn) = c["verdict"], c["descriptor"], c["kernel"]
    lines = [
        "# CPU model against the H200",
        "",
        "Sources: " + ", ".join(f"`{s}`" for s in sources),
        "",
        f"Verdicts agree in {v} of {n} cases; the faulting kernel agrees in {k} of {kn} cases where memcheck named "
        f"one. Descriptors agree in {d} of {dn} cases where the GPU named one (the pass where the verdict arose; a "
        "clean run names none): counted apart, because equal verdicts can come from different passes (a crash at "
        "t48r12 on the GPU, a predicted read at t64r16). A crash or hang counts as the predicted out-of-bounds read. "
        "Padding is the recorded poison; without one it is unknown and the model gives every verdict it cannot rule "
        f"out ({sum(len(r.model_outcomes) > 1 for r in rows)} cases with more than one).",
        "",
        "| case | GPU | GPU kernel | GPU descriptor | model (padding 0) | model can't rule out | model kernel | "
        "model descriptor | verdict agrees | descriptor agrees | kernel agrees |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.case_id} | {r.gpu} | {r.gpu_kernel or '-'} | {r.gpu_descriptor or '-'} | {r.model} | "
            f"{', '.join(r.model_outcomes) or r.model} | {r.model_kernel or '-'} | {r.model_descriptor or '-'} | "
            f"{_mark(r.verdict_agrees)} | {_mark(r.descriptor_agrees)} | {_mark(r.kernel_agrees)} |"
        )
    return "\n".join(lines) + "\n"
