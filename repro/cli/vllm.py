"""`python -m repro gate | vllm-check`: real vLLM builds: the gate, the source check (bisect: repro.cli.bisect)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zipfile
import zlib
from dataclasses import replace
from pathlib import Path

from repro import exit_codes
from repro.cli.common import (
    MAX_REPEAT,
    Given,
    check_out_dir,
    command_started_at,
    gpu_present,
    positive,
    repeats,
    seconds,
    vllm_sources,
)
from repro.cli.outputs import (
    OVERWRITE_HELP,
    check_file,
    check_folder,
    check_inputs_kept,
    json_of,
    open_folder,
)
from repro.errors import ConfigError, Unavailable
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
    sub.choices["vllm-check"].set_defaults(func=cmd_vllm_check)
    sub.choices["gate"].set_defaults(func=cmd_gate)


def cmd_gate(a: argparse.Namespace) -> int:
    """Exit 0: every build under test clean and every control caught; 1: a build under test is affected (a fault, a
    hang, wrong tokens or stale views); 4: a build under test could not be vouched for (a case errored or skipped),
    or the gate cannot run here (no GPU, no vLLM build), said in one line before any case runs; 3: HARNESS BLIND (a
    control missed, or none ran); 2: bad input. A bisect step maps 0 and 1 through, the rest to 125 (untestable)."""
    from repro.report.environment import collect  # the gate's modules load only for it
    from repro.run.memory import gpu_memory_gib  # as above
    from repro.vllm_integration.gate import report as gate_report  # as above
    from repro.vllm_integration.gate.cache import CACHE_ENV, GateCache, default_root  # as above
    from repro.vllm_integration.gate.case import parse_backends, parse_modes, persons_choices  # as above
    from repro.vllm_integration.gate.keep import keep_seconds  # as above
    from repro.vllm_integration.gate.launch import launcher_kind  # as above
    from repro.vllm_integration.gate.paths import parse_paths  # as above
    from repro.vllm_integration.gate.placement import cpu_cores, fit_jobs, gate_devices  # as above
    from repro.vllm_integration.gate.run import run_gate  # as above
    from repro.vllm_integration.releases.builds import (  # as above
        CONTROL,
        UNDER_TEST,
        attach_torch,
        check_label,
        find_builds,
        make_overlays,
        needs_gpu,
        parse_builds,
        parse_overlays,
    )

    moot = (  # an option another makes moot is refused, never ignored
        ("--cache-keep", "cache_keep" in getattr(a, "given", ()) and a.no_cache, "--no-cache keeps no cache"),
        ("--self-control-attempts", "self_control_attempts" in getattr(a, "given", ()) and a.self_control == "none",
         "--self-control none runs no self control"),
        ("--out", a.out is not None and a.dry_run, "--dry-run only lists the case ids, writing nothing"),
    )  # fmt: skip
    for flag, refused, why in moot:
        if refused:
            raise ConfigError(f"{flag} would be ignored: {why}; give one of the two")
    modes, backends = parse_modes(a.modes), parse_backends(a.backends)
    if a.compile not in COMPILES:  # argparse checks a choice typed, never its default, read from the variable
        raise ConfigError(f"REPRO_GATE_COMPILE={a.compile!r}: use one of {', '.join(COMPILES)} (or --compile)")
    persons_choices(os.environ)  # REPRO_WEIGHTS, REPRO_INJECT_SOURCE: judged before anything is written
    if a.compare_paths and (a.no_cache or a.repeat != 1 or a.launcher):
        raise ConfigError(
            "--compare-paths runs each path once, with its own cache and launcher: leave out --no-cache, --repeat and "
            "--launcher"
        )
    forking = not a.compare_paths and launcher_kind(a.launcher) == "fork"
    keep = keep_seconds(a.keep_forkserver, forking, check_dir=not a.dry_run)
    for flag, n in (("--jobs", a.jobs), ("--cache-keep", a.cache_keep)):  # --repeat, --timeout: their types
        if n is not None and n < 1:
            raise ConfigError(f"{flag} must be at least 1, got {n}")
    paths = parse_paths(a.paths, a.compare_paths)
    check_folder(a.out, a.overwrite)  # every value judged before the builds are looked for (no build, no GPU: exit 4)
    check_out_dir(a.logs, "--logs")
    check_out_dir(a.cache_dir, "--cache-dir")
    if a.cache_dir is None and not (a.no_cache or a.compare_paths) and os.environ.get(CACHE_ENV):
        check_out_dir(os.environ[CACHE_ENV], CACHE_ENV)  # where the cache goes by default: judged as --cache-dir
    overlays = parse_overlays(a.overlay)  # judged here, made once the cases can run
    builds = find_builds(include_installed=not a.no_installed)
    for flag, given, role in (("--vllm", a.vllm, UNDER_TEST), ("--control", a.control, CONTROL)):
        builds += [b for item in given for b in parse_builds(item, role, flag)]  # one item: one build, commas kept
    if a.installed_label is not None:  # never ignored: it names the installed vllm's cases
        if a.no_installed:
            raise ConfigError("--installed-label names the installed vllm's cases, which --no-installed leaves out")
        check_label(a.installed_label, "--installed-label")
        builds = [replace(b, label=a.installed_label) if b.prefix is None else b for b in builds]
    # --torch may name an overlay too; an overlay not named runs with its base build's torch (its compiled parts
    # link that one)
    listed = attach_torch(builds + [o.listed() for o in overlays], ",".join(a.torch))
    builds, overlay_torch = listed[: len(builds)], {b.label: b.torch_prefix for b in listed[len(builds) :]}
    labels = [b.label for b in listed]
    if twice := sorted({x for x in labels if labels.count(x) > 1}):  # their case ids and logs would collide
        raise ConfigError(
            f"two builds share the label {twice[0]!r} (--vllm, --control, --overlay): give distinct labels"
        )
    cache_root = None if a.no_cache or (a.compare_paths and not a.cache_dir) else a.cache_dir or default_root()
    kept = [p for b in listed for p in (b.prefix, b.torch_prefix)] + [str(o.sources) for o in overlays]
    check_inputs_kept(a.out, a.overwrite, [*kept, *(str(o.base) for o in overlays), cache_root and str(cache_root)])
    try:
        devices = gate_devices(a.devices)  # judged before anything is written, a dry run's too
    except Unavailable as e:
        print(f"repro: cannot run here: {e}", file=sys.stderr)
        return exit_codes.Exit.NOT_RUN
    if not builds and not overlays:
        gpu = gpu_present()
        print(
            "repro: cannot run here: no vLLM build to test: install vllm, or name builds with --vllm / --control "
            "LABEL=PREFIX"
            + ("" if gpu else "; and no CUDA GPU is visible, which the gate's cases need (without a GPU: "
               "`python -m repro vllm-check` reads a build's sources)"),
            file=sys.stderr,
        )  # fmt: skip
        return exit_codes.Exit.NOT_RUN
    if a.dry_run:
        from repro.vllm_integration.gate.run import plan  # the gate's modules load only for it

        listed = builds + [o.listed() for o in overlays]
        for c in plan(listed, modes, a.repeat, a.timeout, backends, a.self_control, a.compile, a.methods):
            print(c.case_id)
        return exit_codes.Exit.OK
    gpu = gpu_present()  # probed in a child process, and not cached when there is no GPU: once here
    if not gpu and (overlays or needs_gpu(builds)):  # an overlay holds its base's compiled extensions
        print(
            "repro: cannot run here: no CUDA GPU visible, and vLLM's cases run on one "
            "(without a GPU: `python -m repro vllm-check` reads a build's sources)",
            file=sys.stderr,
        )
        return exit_codes.Exit.NOT_RUN
    caveat = {}  # only builds without compiled extensions get here without a GPU: stand-ins (tests/fake_vllm.py)
    if not gpu:  # the reports say so under their headline too: a PASS here vouches for no real vLLM
        caveat = {gate_report.NO_GPU: "these builds have no compiled extensions (stand-ins?); their answer says "
                  "nothing about a real vLLM"}  # fmt: skip
        print(f"[gate] no CUDA GPU: {caveat[gate_report.NO_GPU]}", file=sys.stderr)
    out = open_folder(a.out, "gate", a.overwrite)
    if overlays:
        dest = out / "overlays" if a.out else Path(tempfile.mkdtemp(prefix="repro-overlays-"))
        builds += make_overlays(overlays, dest, builds, overlay_torch)

    def progress(c, r) -> None:
        print(f"[gate] {c.case_id}: {r.verdict} ({r.wall_s:.0f} s) {r.evidence or ''} {r.reason[:160]}", flush=True)

    logs = Path(a.logs) if a.logs else out / "logs"
    if a.jobs is None:
        a.jobs, why = fit_jobs(cpu_cores(), gpu_memory_gib(), len(devices) or 1)
        print(f"[gate] cases at a time: {why} (--jobs to choose)", flush=True)
    if a.compare_paths:
        return _compare_paths(a, paths, builds, modes, backends, out, logs, progress)
    cache = None if a.no_cache else GateCache(Path(a.cache_dir) if a.cache_dir else default_root())
    if cache is not None:
        removed = cache.prune(a.cache_keep, a.cache_max_age_days, protect=builds)
        if removed:
            print(
                f"[gate] cache: removed {len(removed)} build folder(s) unused longest: {', '.join(map(str, removed))}"
            )
    run = run_gate(builds, modes, logs, a.repeat, a.jobs, a.timeout, progress, cache, backends, a.self_control,
                   devices=devices, launcher=a.launcher, deadline_s=a.deadline, compile=a.compile, keep_forkserver=keep,
                   methods=a.methods, self_control_attempts=a.self_control_attempts)  # fmt: skip
    run.setup_s = round(run.started_at - command_started_at(), 2)  # CLI, build discovery, its GPU check
    judgment = run.judge(need_control=not a.no_control)  # the one decision: the reports and the exit code read it
    env = collect() | caveat
    run.command_s = round(time.time() - command_started_at(), 1)  # before its reports, its environment collected
    written = gate_report.write(run, out, env)
    print(gate_report.markdown(run, env, terminal=True))  # verdicts.md's lines up to its per-case tables
    print(f"written: {', '.join(str(p) for p in written)}")
    return exit_codes.gate(judgment.outcome)


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


def _compare_paths(a: argparse.Namespace, paths, builds, modes, backends, out: Path, logs: Path, progress) -> int:
    """`gate --compare-paths`: old path, new path cold, new path warm; each path's gate report in OUT/<path>/,
    the side-by-side table in OUT/paths.md and paths.json. Exit: the last path's gate exit code, or 3 when a case's
    answer differs between the paths (the new path cannot stand in for the old)."""
    from repro.vllm_integration.gate.paths import compare_paths, write_comparison  # the gate's modules: only for it

    cache_root = Path(a.cache_dir) if a.cache_dir else out / "cache"
    runs = compare_paths(
        builds, modes, logs, cache_root, a.jobs, a.timeout, progress, backends, paths, a.self_control, a.compile
    )
    differ = write_comparison(runs, out, need_control=not a.no_control)
    return exit_codes.compare_paths(differ, list(runs.values())[-1].judged().outcome)  # judged in write_comparison
