"""The parametrized case set of `matrix`: its options (MatrixOptions) and its cases (build_specs), positive controls
first. Running them: repro.run.matrix."""

from __future__ import annotations

from dataclasses import dataclass, replace

from repro.case.descriptors import AttnConfig
from repro.case.poison import DEFAULT_POISON
from repro.case.scenarios import DEFAULT_PAIR, FRESH, PAIR, STALE, V2, pair_descriptors
from repro.case.spec import CaseSpec, SmConfig, positive_control
from repro.errors import ConfigError

DEFAULT_SMS = ("sm_margin:16", "mps:16", "full")  # the matrix's SM restrictions (`matrix --sms`)


@dataclass(frozen=True)
class MatrixOptions:
    backends: tuple[str, ...] = ("upstream", "vllm")
    strategies: tuple[str, ...] = (STALE, FRESH)
    sms: tuple[str, ...] = DEFAULT_SMS
    modes: tuple[str, ...] = ("eager", "graph")
    splits: tuple[int, ...] = (32, 0)
    poison: str | None = DEFAULT_POISON
    sanitizer: bool = False
    timeout_s: float = 120.0
    repeat: int = 1
    scenario: str = V2
    cfg: AttnConfig = AttnConfig()
    pair: tuple[str, str] | None = None  # the pair scenario's (built for, launched); None: DEFAULT_PAIR


def run_order(spec: CaseSpec) -> int:
    """Positive controls first, eager ones (a fault shows at the first launch) before graphs: a blind harness shows up
    in the first seconds."""
    return 0 if positive_control(spec) and spec.mode == "eager" else 1 if positive_control(spec) else 2


def build_specs(opts: MatrixOptions) -> list[CaseSpec]:
    for axis in ("backends", "strategies", "sms", "modes", "splits"):
        values = getattr(opts, axis)
        dups = sorted({str(v) for v in values if values.count(v) > 1})
        if dups:
            raise ConfigError(f"--{axis}: {', '.join(dups)} given twice (one case id each; use --repeat to run again)")
    pair = None
    if opts.scenario == PAIR:
        pair = opts.pair or DEFAULT_PAIR
        pair_descriptors(pair, opts.cfg)  # a bad or too large descriptor: one line, before any case runs
    elif opts.pair:
        raise ConfigError(f"--built-for and --launched describe the pair scenario, not --scenario {opts.scenario}")
    specs = []
    for backend in opts.backends:
        for strategy in opts.strategies:
            for sm in opts.sms:
                for mode in opts.modes:
                    for splits in opts.splits:
                        cfg = opts.cfg.with_(num_splits=splits)
                        specs.append(
                            CaseSpec(
                                backend,
                                strategy,
                                mode,
                                opts.scenario,
                                sm=SmConfig.parse(sm),
                                cfg=cfg,
                                poison=opts.poison,
                                sanitizer=opts.sanitizer,
                                pair=pair,
                                timeout_s=opts.timeout_s,
                            )
                        )
    if not specs:
        raise ConfigError("the matrix is empty: every axis needs at least one value")
    ids = [s.case_id for s in specs]
    if len(set(ids)) != len(ids):  # e.g. sm_margin:132 and full on an H200 differ in name only
        raise ConfigError(f"two cases share one id: {next(i for i in ids if ids.count(i) > 1)}")
    specs.sort(key=run_order)

    return [replace(s, rep=k) for s in specs for k in range(opts.repeat)]
