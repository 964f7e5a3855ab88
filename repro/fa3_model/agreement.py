"""The model's predicted verdicts against the GPU's recorded verdicts on the same cases."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from repro.descriptors import AttnConfig
from repro.fa3_model.predict import H200_SMS, predict_case, predict_outcomes
from repro.layout import UPSTREAM, VLLM
from repro.report import MODEL, load_json
from repro.verdicts import CRASH, ERROR, HANG, OOB, SKIP


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
        gpu = "oob" if self.gpu in (OOB, CRASH, HANG) else self.gpu
        return gpu in (self.model_outcomes or (self.model,))

    @property
    def kernel_agrees(self) -> bool | None:
        if not self.gpu_kernel or self.gpu != OOB:
            return None
        return self.gpu_kernel == self.model_kernel


def compare(paths: list[str | Path]) -> list[Agreement]:
    """Every eager V2 case of the given runs whose SM count the model covers (sm_margin, MPS or the whole GPU)."""
    out = []
    flavors = {"upstream": UPSTREAM, "vllm": VLLM}
    for path in paths:
        run = load_json(path)
        if run.source == MODEL:  # predictions: nothing measured to compare with
            continue
        for s, r in run.results:
            if s.mode != "eager" or s.scenario != "v2-capture" or s.sm.kind not in ("sm_margin", "mps", "full"):
                continue
            if r.verdict in (SKIP, ERROR):  # the GPU gave no verdict to compare with
                continue
            sms = s.sm.sms or H200_SMS
            cfg = AttnConfig.from_dict({**s.cfg.to_dict()})
            pred, desc = predict_case(flavors[s.backend], s.strategy, sms, cfg, s.poison, s.sanitizer)
            outcomes = predict_outcomes(flavors[s.backend], s.strategy, sms, cfg, s.poison, s.sanitizer)
            out.append(
                Agreement(s.case_id, r.verdict, r.kernel, r.descriptor, pred.verdict, pred.kernel, desc, outcomes)
            )
    return out


def markdown(rows: list[Agreement], sources: list[str]) -> str:
    v = sum(r.verdict_agrees for r in rows)
    k = [r.kernel_agrees for r in rows if r.kernel_agrees is not None]
    lines = [
        "# CPU model against the H200",
        "",
        "Sources: " + ", ".join(f"`{s}`" for s in sources),
        "",
        f"Verdicts agree in {v} of {len(rows)} cases; the faulting kernel agrees in {sum(k)} of {len(k)} "
        "cases where memcheck named one. Padding is the recorded poison; without one it is unknown and the model "
        f"gives every verdict it cannot rule out ({sum(len(r.model_outcomes) > 1 for r in rows)} cases with "
        "more than one).",
        "",
        "| case | GPU | GPU kernel | GPU descriptor | model (padding 0) | model can't rule out | model kernel | "
        "model descriptor | agrees |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mark = (
            "yes"
            if r.verdict_agrees and r.kernel_agrees is not False
            else ("verdict only" if r.verdict_agrees else "NO")
        )
        lines.append(
            f"| {r.case_id} | {r.gpu} | {r.gpu_kernel or '-'} | {r.gpu_descriptor or '-'} | {r.model} | "
            f"{', '.join(r.model_outcomes) or r.model} | {r.model_kernel or '-'} | {r.model_descriptor or '-'} | {mark} |"
        )
    return "\n".join(lines) + "\n"
