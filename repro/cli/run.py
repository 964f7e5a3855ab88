"""`python -m repro run`: one attention-layer case."""

from __future__ import annotations

import argparse
import json
import os
import sys

from repro import exit_codes
from repro.case.scenarios import DEFAULT_PAIR, PAIR, SCENARIOS, STRATEGIES, V2, pair_descriptors
from repro.case.spec import CaseSpec, SmConfig
from repro.cli.common import (
    add_shape_args,
    check_exists,
    check_file_and_folder,
    gpu_present,
    poison_arg,
    shape_config,
    splits,
)
from repro.cli.outputs import check_file, check_folder, json_of, open_folder
from repro.errors import ConfigError, Unavailable
from repro.files import write_whole
from repro.run.runner import device_sm_count, run_case
from repro.run.smcontrol import maybe_mps, sm_refusal


def add_parsers(sub) -> None:
    r = sub.add_parser("run", help="run one case")
    r.add_argument(
        "--backend",
        choices=("upstream", "vllm"),
        required=True,
        help="FA3 build: upstream (flash_attn_3 from PyPI tokenspeed-fa3) or vllm (vLLM's _vllm_fa3_C) (required)",
    )
    r.add_argument(
        "--backend-path",
        help="upstream: folder with flash_attn_3/; vllm: path to _vllm_fa3_C*.so (default: the installed one)",
    )
    r.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default="stale",
        help="stale: the draft reuses the target's metadata views (the bug); fresh: rebuilt per pass (default %(default)s)",
    )
    r.add_argument(
        "--mode",
        choices=("eager", "graph"),
        default="eager",
        help="eager: the draft's warmup pass; graph: captured into a CUDA graph and replayed (default %(default)s)",
    )
    r.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default=V2,
        help="v2-capture: vLLM's capture order; pair: built for --built-for, launched as --launched; spec-decode: "
        "target and draft models (default %(default)s)",
    )
    r.add_argument(
        "--sm", default="full", help="SMs: full, sm_margin:N, mps:N, green:N, mig[:uuid] (default %(default)s)"
    )
    r.add_argument(
        "--num-splits", type=int, default=32, help="FA3 num_splits; 0 = FA3's heuristic (default %(default)s)"
    )
    r.add_argument("--built-for", help=f"pair scenario: descriptor the buffers hold (default {DEFAULT_PAIR[0]})")
    r.add_argument("--launched", help=f"pair scenario: descriptor launched (default {DEFAULT_PAIR[1]})")
    r.add_argument("--json", help="write the result here (default: none)")
    add_shape_args(r)
    sub.choices["run"].set_defaults(func=cmd_run)


def check_backend_path(backend: str, path: str | None) -> None:
    """--backend-path of the kind its backend loads (repro.backends): upstream a folder holding flash_attn_3/, vllm
    vLLM's _vllm_fa3_C*.so, a shared library; judged before the GPU is looked for."""
    if path is None:
        return
    check_exists(path)
    if backend == "upstream" and not os.path.isdir(os.path.join(path, "flash_attn_3")):
        raise ConfigError(
            f"--backend-path {path}: upstream takes a folder holding flash_attn_3/ (a tokenspeed-fa3 tree)"
        )
    if backend == "vllm":
        if not os.path.isfile(path):
            raise ConfigError(f"--backend-path {path}: vllm takes vLLM's _vllm_fa3_C*.so file, not a folder")
        try:
            with open(path, "rb") as f:
                head = f.read(4)
        except OSError as e:
            raise ConfigError(f"--backend-path {path}: cannot read it ({e.strerror or e})") from None
        if head != b"\x7fELF":
            raise ConfigError(f"--backend-path {path}: not a shared library (vllm takes vLLM's _vllm_fa3_C*.so)")


def cmd_run(a: argparse.Namespace) -> int:

    check_backend_path(a.backend, a.backend_path)
    check_file_and_folder(a.json, a.out)
    check_file(a.json, own=json_of(lambda doc: "verdict" in doc and "case_id" in doc))  # a result `run` wrote
    check_folder(a.out, a.overwrite)
    sm = SmConfig.parse(a.sm)
    cfg = shape_config(a, splits((a.num_splits,), "--num-splits")[0])
    if a.scenario != PAIR and (a.built_for or a.launched):  # as matrix refuses them: never ignored
        raise ConfigError(f"--built-for and --launched describe the pair scenario, not --scenario {a.scenario}")
    pair = (a.built_for or DEFAULT_PAIR[0], a.launched or DEFAULT_PAIR[1]) if a.scenario == PAIR else None
    if pair:
        pair_descriptors(pair, cfg)
    if sm.sms and gpu_present() and (why := sm_refusal(sm.kind, sm.sms, device_sm_count())):
        raise ConfigError(f"--sm {why}")
    spec = CaseSpec(
        a.backend,
        a.strategy,
        a.mode,
        a.scenario,
        sm,
        cfg,
        poison_arg(a.poison),
        a.sanitizer,
        pair,
        a.backend_path,
        a.timeout,
    )
    if not gpu_present():
        print(
            f"skip: no CUDA GPU here, {spec.case_id} cannot run. For the CPU model's prediction of such cases: "
            "python -m repro matrix --model",
            file=sys.stderr,
        )
        return exit_codes.Exit.NOT_RUN
    out = open_folder(a.out, "run", a.overwrite)
    try:
        with maybe_mps(sm.kind == "mps") as mps:
            res = run_case(spec, out, mps)
    except Unavailable as e:
        print(f"skip: {e}", file=sys.stderr)
        return exit_codes.Exit.NOT_RUN
    print(f"logs: {out}")
    print(f"{res.verdict}: {res.case_id}\n  {res.reason}")
    if res.kernel:
        print(f"  kernel: {res.kernel}")
    if res.stale_fields:
        print(f"  stale fields: {res.stale_fields}")
    for d in res.first_diffs:
        print(f"  {d}")
    if a.json:
        write_whole(a.json, json.dumps(res.to_dict(), indent=1) + "\n")
    return exit_codes.run(res.verdict)
