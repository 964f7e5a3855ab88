"""`python -m repro gate | vllm-check`: real vLLM builds: the gate, the source check (bisect: repro.cli.bisect)."""

from __future__ import annotations

import argparse
import json
import os
import zipfile
import zlib
from pathlib import Path

from repro import exit_codes
from repro.cli.common import (
    MAX_REPEAT,
    Given,
    GivenFlag,
    positive,
    repeats,
    seconds,
    vllm_sources,
)
from repro.cli.gate import cmd_gate
from repro.cli.outputs import (
    OVERWRITE_HELP,
    check_file,
    json_of,
)
from repro.files import write_whole
from repro.vllm_integration.gate.methods import add_option as add_methods_option
from repro.vllm_integration.gate.worker import COMPILES, DEFAULT_COMPILE
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND


def add_parsers(sub) -> None:
    what = (
        "code patterns and auditor hooks of vLLM checkouts or wheels (no import; cannot vouch, never 'good': files are "
        "checked against their own RECORD, not the published release's); exit 0 no known bad pattern, 1 bad, 125 untestable"
    )
    vc = sub.add_parser("vllm-check", help=what, description=what)
    vc.add_argument("sources", nargs="+", help="vLLM checkout folders or .whl files")
    vc.add_argument("--json", help="also write the verdicts here as JSON (default: none)")
    gt = sub.add_parser("gate", help="is this vLLM build affected? real vLLM, every detection mode, one table")
    _gate_cases(gt)
    _gate_builds(gt)
    _gate_run_options(gt)
    _gate_outputs(gt)
    _gate_launch(gt)
    sub.choices["vllm-check"].set_defaults(func=cmd_vllm_check)
    sub.choices["gate"].set_defaults(func=cmd_gate)


def _gate_cases(gt: argparse.ArgumentParser) -> None:
    """`gate`'s options: what each case runs: modes, methods, backends, torch.compile."""
    gt.add_argument(
        "--modes",
        default="audit,plain",
        help="audit, plain, mps:N, sm_margin:N, audit+mps:N, audit+sm_margin:N, poison:FILL, memcheck[:async|:own], memcheck:own+poison:FILL (own: gating, needs nvcc), or the "
        "preset hidden-sweep (audit and plain on the full GPU and at 8/16/24/40/66 SMs of both restrictions) "
        "(default audit,plain)",
    )
    add_methods_option(gt)
    gt.add_argument(
        "--backends",
        default=DEFAULT_BACKEND,
        help="vLLM attention backends, each a case parameter: FLASH_ATTN, TRITON_ATTN, FLASHINFER... "
        "(sm_margin and poison modes: FLASH_ATTN only) (default %(default)s)",
    )
    gt.add_argument(
        "--compile",
        choices=COMPILES,
        default=os.environ.get("REPRO_GATE_COMPILE") or DEFAULT_COMPILE,
        help="torch.compile of the speculative cases: inductor (what vLLM users run) or none (FULL CUDA graphs of the "
        "eager model: no compile seconds per case, but another engine configuration, recorded for 0.23.0 to 0.26.0 "
        "only: docs/vllm-gate.md#speed) (default: REPRO_GATE_COMPILE, else %(default)s)",
    )


def _gate_builds(gt: argparse.ArgumentParser) -> None:
    """`gate`'s options: which builds: under test, known-bad controls, their torch, overlays, self controls."""
    gt.add_argument(
        "--vllm",
        action="append",
        default=[],
        help="LABEL=PREFIX: a build under test, PREFIX the folder holding vllm/ "
        "(also REPRO_VLLM; default: the installed vllm)",
    )
    gt.add_argument(
        "--control",
        action="append",
        default=[],
        help="LABEL=PREFIX: a known-bad build the gate must catch (also REPRO_VLLM_CONTROL; default: none)",
    )
    gt.add_argument(
        "--devices",
        default=None,
        help="where the case processes run: all (every GPU, or the smallest MIG slices on a MIG runner), or a list "
        "of indices / UUIDs, one case per device at a time (--jobs divided over them) (default: this process's "
        "device)",
    )
    gt.add_argument(
        "--torch",
        action="append",
        default=[],
        help="LABEL=PREFIX: a torch of its own for one build (a release that pins another torch: PREFIX holds torch/, "
        "put before the build on its cases' PYTHONPATH) (default: the installed torch)",
    )
    gt.add_argument(
        "--overlay",
        action="append",
        default=[],
        help="LABEL=SOURCES@BASE: a build under test made of a release's Python sources (a folder holding vllm/) over "
        "the compiled parts and dependencies of the build at BASE; refused when their torch pins or required "
        "extension modules differ (default: none)",
    )
    gt.add_argument("--no-installed", action="store_true", help="leave out the vllm this Python imports")
    gt.add_argument("--installed-label", help="case-id label of the installed vllm (default: its version)")
    gt.add_argument(
        "--no-control", action="store_true", help="answer for the builds alone (bisect steps): no control needed"
    )
    gt.add_argument(
        "--self-control",
        default="under-test",
        choices=("under-test", "all", "none"),
        help="which builds also run as their own positive control, the capture defect re-created inside them, in "
        "every mode: under-test (every build under test), all (known-bad controls too), none (default %(default)s)",
    )


def _gate_run_options(gt: argparse.ArgumentParser) -> None:
    """`gate`'s options: how long and how many: repetitions, attempts, jobs, timeouts."""
    gt.add_argument(
        "--repeat", type=repeats, default=1, help=f"repetitions of every case, 1 to {MAX_REPEAT} (default 1)"
    )
    gt.add_argument(
        "--self-control-attempts",
        action=Given,
        type=repeats,
        default=3,
        help="attempts in all of a self control outside the audit mode that decoded without a fault, until one "
        "faults or hangs (default %(default)s; 1: no second attempt)",
    )
    gt.add_argument(
        "--name-control-kernels",
        action=GivenFlag,
        help="rerun a self control's plain-mode crash with CUDA_LAUNCH_BLOCKING=1 beside it, to name the kernel that "
        "faulted (default: only a build's own crash is rerun; a self control's fault is its mode's evidence whichever "
        "kernel faulted)",
    )
    gt.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="cases at a time, MPS cases aside (default: fitted to this machine: half its CPU cores, no more than "
        "the GPU's free memory holds at 4 GiB a case)",
    )
    gt.add_argument("--timeout", type=seconds, default=300.0, help="seconds per case process (default 300)")
    gt.add_argument(
        "--deadline",
        type=seconds,
        default=None,
        help="seconds for the whole run: no case starts after it, a running one is stopped at it; those cases are "
        "skips that say so, and the report is written (a CI job's time limit; default: none)",
    )


def _gate_outputs(gt: argparse.ArgumentParser) -> None:
    """`gate`'s options: where it writes: the report folder, logs, the cache, the paths compared."""
    gt.add_argument(
        "--out",
        help="a new or empty folder for verdicts.md, results.json, logs/ (default: a new folder under the temp folder)",
    )
    gt.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)
    gt.add_argument("--logs", help="folder for each case's output and logs (default OUT/logs)")
    gt.add_argument(
        "--cache-dir",
        help="where each build's vLLM caches and reference runs are kept, keyed by the build's fingerprint "
        "(default: REPRO_CACHE_DIR, else ~/.cache/repro)",
    )
    gt.add_argument(
        "--cache-keep",
        action=Given,
        type=int,
        default=12,
        help="build folders the cache keeps, the most recently used (this run's among them) (default %(default)s)",
    )
    gt.add_argument(
        "--cache-max-age-days",
        type=positive,
        default=30.0,
        help="a build folder unused this long is removed from the cache (default %(default)s)",
    )
    gt.add_argument(
        "--no-cache", action="store_true", help="the old path: every case cold, every reference run (default: off)"
    )
    gt.add_argument(
        "--compare-paths",
        action="store_true",
        help="benchmark: the old path, then the new path cold (an empty cache folder: --cache-dir, default "
        "OUT/cache) and warm, in one command; writes paths.md/paths.json, exit 3 when the paths' verdicts differ",
    )
    gt.add_argument(
        "--paths",
        help="with --compare-paths: which paths to run, in this order, from old, new-cold, new-warm (spawned case "
        "processes), fork-cold, fork-warm (forked from each build's forkserver), kept-cold, kept-warm (forked from "
        "forkservers kept between the two runs) (default: the first five)",
    )


def _gate_launch(gt: argparse.ArgumentParser) -> None:
    """`gate`'s options: how case processes start, and a dry run."""
    gt.add_argument(
        "--launcher",
        choices=("fork", "spawn"),
        help="how case processes start: fork (from a forkserver per build that imported torch, vLLM and the plugin "
        "once; a case that cannot be forked is launched plainly, and the report says why) or spawn (a fresh "
        "interpreter per case) (default: REPRO_GATE_LAUNCHER, else fork: the same verdicts as spawn on the H200, "
        "docs/vllm-gate.md#speed)",
    )
    gt.add_argument(
        "--keep-forkserver",
        type=seconds,
        default=None,
        metavar="S",
        help="with --launcher fork: each build's forkserver serves later runs (same build, environment, harness "
        "code: no import of torch and vLLM) until S s pass without one (default: REPRO_GATE_KEEP_FORKSERVER, else none)",
    )
    gt.add_argument("--dry-run", action="store_true", help="list case ids only")


def cmd_vllm_check(a: argparse.Namespace) -> int:
    from repro.vllm_integration.releases.compat import Compat, check_source  # only for vllm-check
    from repro.vllm_integration.releases.source_check import UNTESTABLE  # as above
    from repro.vllm_integration.releases.versions import measured  # only for vllm-check

    rows, damaged = [], vllm_sources(a.sources)  # bad input refused; a damaged wheel: untestable
    check_file(a.json, inputs=tuple(a.sources), own=json_of(lambda rows: all("verdict" in r for r in rows)))
    for path in a.sources:
        try:
            if path in damaged:
                raise zipfile.BadZipFile(damaged[path])
            c = check_source(path)
        except (zipfile.BadZipFile, zlib.error, EOFError, OSError) as e:  # a damaged member: judged nothing
            c = Compat(Path(path).name, UNTESTABLE, f"cannot read the wheel ({type(e).__name__}: {e})", None, False, [])
        rows.append(c.to_dict())
        print("\n".join(c.describe()))
        # a release's GPU record measured its published files, which these were not compared with (compat)
        print(f"  these files: {measured(None)}" + (" (the GPU record above is the release's)" if c.gpu_record else ""))
    if a.json:
        write_whole(a.json, json.dumps(rows, indent=1) + "\n")
    return exit_codes.source(r["verdict"] for r in rows)
