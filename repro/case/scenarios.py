"""Scenarios at the attention layer and the stale / fresh metadata strategies.

A scenario yields the draft's passes in order: (descriptor, stage, metadata the pass gets). Builds happen lazily,
so a fresh rebuild lands in the buffers right before its pass, exactly as in vLLM's capture loop."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from repro.case.descriptors import (
    AttnConfig,
    BatchDescriptor,
    ConfigError,
    descriptor_from_label,
    full_decode_descriptors,
)


class MetadataBuilder(Protocol):
    """What a scenario asks of the builder it is handed (the attention layer's repro.attention.builder.MetadataBuilder,
    one layer up: named here by what it does, so this layer imports nothing above it)."""

    cfg: AttnConfig

    def build(self, desc: BatchDescriptor) -> Any:
        """The metadata for one descriptor's pass, built through the builder's persistent buffers."""


AttnMetadata = Any  # what MetadataBuilder.build returns (repro.attention.builder.AttnMetadata): a pass carries it

STALE = "stale"
FRESH = "fresh"
STRATEGIES = (STALE, FRESH)
PAIR = "pair"
V2 = "v2-capture"
SPEC = "spec-decode"  # target + draft models, capture runner and decoding loop (repro.specdecode)
SCENARIOS = (PAIR, V2, SPEC)
WARMUP = "warmup"
CAPTURE = "capture"
TARGET, DRAFT_PREFILL = "target", "draft-prefill"


@dataclass
class Pass:
    descriptor: BatchDescriptor
    stage: str  # warmup (eager pass before capture) or capture
    metadata: AttnMetadata
    model: str = DRAFT_PREFILL  # whose pass: the target's or the draft's prefill


def check_strategy(strategy: str) -> None:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


def v2_capture_sequence(
    builder: MetadataBuilder,
    strategy: str,
    descriptors: list[BatchDescriptor] | None = None,
    with_target: bool = False,
) -> Iterator[Pass]:
    """vLLM V2: the target builds every FULL descriptor largest first (warmup build + capture build), then the draft
    runs each descriptor's warmup and capture. stale: the draft reuses the target's saved states (before PR #48261);
    fresh: the draft rebuilds through the same buffers for every pass (after the fix). with_target: the target's own
    passes are yielded too, each right after its build (the model runner in repro.specdecode runs them); the attention
    layer runs the draft's only. The one capture sequence of the project."""
    check_strategy(strategy)
    descs = descriptors or full_decode_descriptors(builder.cfg)
    saved: dict[BatchDescriptor, tuple[AttnMetadata, AttnMetadata]] = {}
    for d in descs:
        warm = builder.build(d)
        if with_target:
            yield Pass(d, WARMUP, warm, TARGET)
        cap = builder.build(d)
        if with_target:
            yield Pass(d, CAPTURE, cap, TARGET)
        saved[d] = (warm, cap)
    for d in descs:
        if strategy == STALE:
            warm, cap = saved[d]
            yield Pass(d, WARMUP, warm)
            yield Pass(d, CAPTURE, cap)
        else:
            yield Pass(d, WARMUP, builder.build(d))
            yield Pass(d, CAPTURE, builder.build(d))


DEFAULT_PAIR = ("t4r1", "t32r8")  # the pair scenario's (built for, launched) when none is named: one request, eight


def pair_descriptors(pair: tuple[str, str], cfg: AttnConfig) -> tuple[BatchDescriptor, BatchDescriptor]:
    """(built for, launched) of a pair case, or ConfigError (one line) for a bad label or one over the max batch:
    checked where a case is made, before anything runs."""
    descs = tuple(descriptor_from_label(x, cfg.decode_query_len) for x in pair)
    for label, d in zip(pair, descs):
        if d.num_reqs > cfg.max_batch:
            raise ConfigError(f"descriptor {label} has {d.num_reqs} requests, over the max batch {cfg.max_batch}")
    return descs  # type: ignore[return-value]


def pair_sequence(
    builder: MetadataBuilder, strategy: str, built_for: BatchDescriptor, launched: BatchDescriptor
) -> Iterator[Pass]:
    """Views saved when `launched` was built, buffers then overwritten by a build for `built_for` (stale);
    or a rebuild for `launched` right before its launch (fresh)."""
    check_strategy(strategy)
    saved = builder.build(launched)
    builder.build(built_for)
    for stage in (WARMUP, CAPTURE):
        yield Pass(launched, stage, saved if strategy == STALE else builder.build(launched))


def passes_for(
    scenario: str,
    builder: MetadataBuilder,
    strategy: str,
    pair: tuple[str, str] | None = None,
) -> Iterator[Pass]:
    """The draft passes of an attention-layer scenario (spec-decode runs through repro.specdecode instead)."""
    if scenario == V2:
        return v2_capture_sequence(builder, strategy)
    if scenario == PAIR:
        if not pair:
            raise ConfigError("the pair scenario needs --built-for and --launched descriptors")
        return pair_sequence(builder, strategy, *pair_descriptors(pair, builder.cfg))
    raise ConfigError(f"unknown scenario {scenario!r}; choose from {', '.join(SCENARIOS)}")
