"""The GPU case sets of the pytest tier, in one place: the cases/ modules parametrize over these CaseSpecs, and a CPU
test collects every one of them to check that no two share a case id (a case id names the case's log files).

- v2-capture: the matrix (repro.case.matrix.build_specs) over both FA3 builds, stale/fresh, sm_margin:16 / full / mps:16 /
  mig, eager/graph, 32 splits and FA3's heuristic, poisoned padding;
- memcheck: unpoisoned, FA3's split heuristic at 16 SMs, under compute-sanitizer;
- pair: metadata built for one request, launched for eight;
- spec-decode: real target and draft models; a pairwise covering set of (speculative tokens, attention shape, page
  size, capture sizes, SM restriction), each row with both FA3 builds and both strategies (REPRO_SPEC_SWEEP=full: the
  whole cross product)."""

from __future__ import annotations

import itertools
import os

from repro.case.descriptors import AttnConfig
from repro.case.matrix import MatrixOptions, build_specs
from repro.case.scenarios import DEFAULT_PAIR, FRESH, STALE
from repro.case.spec import CaseSpec, SmConfig

BACKENDS = ("vllm", "upstream")
STRATEGIES = (STALE, FRESH)


def v2_capture() -> list[CaseSpec]:
    return build_specs(
        MatrixOptions(
            backends=BACKENDS,
            strategies=STRATEGIES,
            sms=("sm_margin:16", "full", "mps:16", "mig"),
            modes=("eager", "graph"),
            splits=(32, 0),
            poison="int-max",
            timeout_s=120,
        )
    )


def memcheck() -> list[CaseSpec]:
    sm, cfg = SmConfig.parse("sm_margin:16"), AttnConfig(num_splits=0)
    return [
        CaseSpec(b, st, "eager", sm=sm, cfg=cfg, sanitizer=True, timeout_s=180) for b in BACKENDS for st in STRATEGIES
    ]


def pair() -> list[CaseSpec]:
    sm = SmConfig.parse("sm_margin:16")
    return [
        CaseSpec("vllm", st, "eager", scenario="pair", pair=DEFAULT_PAIR, poison="int-max", sm=sm, timeout_s=120)
        for st in STRATEGIES
    ]


SHAPES = {"h32-8x128": (32, 8, 128), "h16-16x128": (16, 16, 128), "h32-4x64": (32, 4, 64)}  # GQA 4, 1 and 8
CAPTURES = {"cap1-64": (1, 2, 4, 8, 16, 32, 64), "cap4-16": (4, 8, 16)}
SPEC_DECODE_AXES = {  # axis -> {value id: value}
    "spec_tokens": {"k1": 1, "k3": 3},
    "shape": SHAPES,
    "page_size": {"page16": 16, "page64": 64},
    "capture_sizes": CAPTURES,
    "sm": {"smmargin16": "sm_margin:16", "sm-all": "full"},
}
PAIRWISE = [  # every pair of values of any two axes appears in some row (tests/test_case_identity.py checks it)
    ("k1", "h32-8x128", "page16", "cap1-64", "smmargin16"),
    ("k3", "h32-8x128", "page64", "cap4-16", "sm-all"),
    ("k1", "h16-16x128", "page64", "cap4-16", "smmargin16"),
    ("k3", "h16-16x128", "page16", "cap1-64", "sm-all"),
    ("k1", "h32-4x64", "page16", "cap4-16", "sm-all"),
    ("k3", "h32-4x64", "page64", "cap1-64", "smmargin16"),
]


def spec_decode_rows(environ=os.environ) -> list[tuple[str, ...]]:
    if environ.get("REPRO_SPEC_SWEEP") == "full":
        return list(itertools.product(*SPEC_DECODE_AXES.values()))
    return PAIRWISE


def spec_decode(environ=os.environ) -> list[CaseSpec]:
    out = []
    for row in spec_decode_rows(environ):
        v = {axis: SPEC_DECODE_AXES[axis][x] for axis, x in zip(SPEC_DECODE_AXES, row)}
        hq, hkv, d = v["shape"]
        cfg = AttnConfig(
            num_heads_q=hq,
            num_heads_kv=hkv,
            head_dim=d,
            page_size=v["page_size"],
            num_speculative_tokens=v["spec_tokens"],
            capture_sizes=v["capture_sizes"],
            max_num_seqs=64,
        )
        for b in BACKENDS:
            for st in STRATEGIES:
                sm = SmConfig.parse(v["sm"])
                out.append(
                    CaseSpec(b, st, "eager", scenario="spec-decode", sm=sm, cfg=cfg, poison="int-max", timeout_s=300)
                )
    return out


def all_gpu_cases() -> dict[str, list[CaseSpec]]:
    return {"v2-capture": v2_capture(), "memcheck": memcheck(), "pair": pair(), "spec-decode": spec_decode()}


def params(specs: list[CaseSpec]):
    """pytest params, one per case, with the case id (minus the common prefix) as the test id."""
    import pytest  # pytest only for the pytest tier's params: the case sets load without it

    return [pytest.param(s, id=s.case_id.removeprefix("stale_metadata-")) for s in specs]
