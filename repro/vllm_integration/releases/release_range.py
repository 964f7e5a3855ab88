"""The affected range across vLLM releases, from one gate run over several builds (`python -m repro gate --vllm A=...
--vllm B=... [--control ...]`): each build's GPU answer (bad: the bug showed in some gating mode; good: clean in
every mode; cannot vouch) in version order, the transitions between neighbours (where the bug came in, where it was
fixed: last good / first bad, last bad / first good), and the source check's opinion beside the GPU's, with every
disagreement flagged. Pure: it reads gate_report.build_summary rows."""

from __future__ import annotations

import re
from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

GOOD, BAD, UNSURE = "good", "bad", "cannot vouch"


def version_key(version: str | None) -> tuple:
    """PEP 440 order (0.26.0rc1 < 0.26.0 < 0.26.1.dev5+g1234); a version it cannot parse by its numbers after the
    parsed ones; unknown versions last."""
    if not version:
        return (2,)
    try:
        return (0, Version(version))
    except InvalidVersion:
        nums = [int(x) for x in re.findall(r"\d+", version.split("+")[0])[:4]]
        return (1, tuple(nums + [0] * (4 - len(nums))), version)


@dataclass(frozen=True)
class Release:
    build: str
    version: str | None
    gpu: str  # GOOD, BAD or UNSURE
    source: str  # the source check's verdict (good, bad, untestable, -)
    evidence: str

    @property
    def disagrees(self) -> bool:
        return self.gpu in (GOOD, BAD) and self.source in (GOOD, BAD) and self.gpu != self.source


def releases(summaries: list[dict]) -> list[Release]:
    """One Release per build summary (gate_report.build_summary), in version order."""
    out = []
    for s in summaries:
        gpu = BAD if s["affected"] else UNSURE if s["could_not_vouch"] or not s["modes"] else GOOD
        evidence = ", ".join(s["detected_in"]) if s["affected"] else ", ".join(s["could_not_vouch"])
        out.append(Release(s["build"], s.get("vllm_version"), gpu, s.get("source_check") or "-", evidence or "-"))
    return sorted(out, key=lambda r: version_key(r.version))


def transitions(rels: list[Release]) -> list[str]:
    """Where the GPU answer changes between neighbours that both have one (a cannot-vouch build in between is named)."""
    out = []
    known = [r for r in rels if r.gpu != UNSURE]
    for a, b in zip(known, known[1:]):
        if a.gpu == b.gpu:
            continue
        between = [r.build for r in rels if version_key(a.version) < version_key(r.version) < version_key(b.version)]
        gap = f" (between them, cannot vouch: {', '.join(between)})" if between else ""
        if b.gpu == BAD:
            out.append(f"introduced: last good {a.build}, first bad {b.build}{gap}")
        else:
            out.append(f"fixed: last bad {a.build}, first good {b.build}{gap}")
    return out


def markdown(summaries: list[dict]) -> list[str]:
    rels = releases(summaries)
    if len(rels) < 2:
        return []
    lines = ["## Affected range across the builds of this run", ""]
    lines += ["| build | vLLM | GPU | evidence | source check | |", "|---|---|---|---|---|---|"]
    for r in rels:
        flag = "**DISAGREE**" if r.disagrees else ""
        lines.append(f"| {r.build} | {r.version or '?'} | **{r.gpu}** | {r.evidence} | {r.source} | {flag} |")
    lines.append("")
    lines += [f"- {t}" for t in transitions(rels)] or ["- no transition: every build gave the same answer"]
    for r in rels:
        if r.disagrees:
            lines.append(f"- DISAGREEMENT: {r.build}: the GPU says {r.gpu}, the source check says {r.source}")
    return lines + [""]


def to_json(summaries: list[dict]) -> dict:
    rels = releases(summaries)
    return {
        "releases": [{**r.__dict__, "disagrees": r.disagrees} for r in rels],
        "transitions": transitions(rels),
    }
