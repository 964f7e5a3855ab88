"""`python -m repro gate`'s command (registered by repro.cli.vllm): its steps in order, each a function of its own:
the options judged (`_judge_options`), the builds found (`_find_builds`), whether it can run here (`_cannot_run`),
the run and its reports (`_run_and_report`), or `--compare-paths` (`_compare_paths`). Every value is judged before
anything is written; the gate's modules load only when it runs (the imports inside these functions)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from repro import exit_codes
from repro.cli.common import check_out_dir, command_started_at, gpu_present
from repro.cli.outputs import check_folder, check_inputs_kept, open_folder
from repro.errors import ConfigError, Unavailable
from repro.vllm_integration.gate.worker import COMPILES


@dataclass
class _Options:
    """What the command's flags decide once judged (`_judge_options`)."""

    modes: tuple
    backends: tuple[str, ...]
    keep: float | None  # --keep-forkserver's seconds
    paths: tuple  # --paths / --compare-paths


@dataclass
class _Builds:
    """The builds the command tests (`_find_builds`): those found and named, the overlays still to be made."""

    builds: list
    overlays: list
    overlay_torch: dict[str, str | None]  # overlay label -> the torch it runs with


def cmd_gate(a: argparse.Namespace) -> int:
    """Exit 0: every build under test clean and every control caught; 1: a build under test is affected (a fault, a
    hang, wrong tokens or stale views); 4: a build under test could not be vouched for (a case errored or skipped),
    or the gate cannot run here (no GPU, no vLLM build), said in one line before any case runs; 3: HARNESS BLIND (a
    control missed, or none ran); 2: bad input. A bisect step maps 0 and 1 through, the rest to 125 (untestable)."""
    from repro.vllm_integration.gate.placement import gate_devices  # the gate's modules load only for it

    opts = _judge_options(a)
    found = _find_builds(a)
    try:
        devices = gate_devices(a.devices)  # judged before anything is written, a dry run's too
    except Unavailable as e:
        print(f"repro: cannot run here: {e}", file=sys.stderr)
        return exit_codes.Exit.NOT_RUN
    if not found.builds and not found.overlays:
        return _cannot_run(
            "no vLLM build to test: install vllm, or name builds with --vllm / --control LABEL=PREFIX",
            None if gpu_present() else "; and no CUDA GPU is visible, which the gate's cases need",
        )
    if a.dry_run:
        return _dry_run(a, opts, found)
    from repro.vllm_integration.ci.command import ended_as_ctrl_c  # as gate_devices: loaded only for a run

    with ended_as_ctrl_c():  # a cancelled CI job's SIGTERM, a closed terminal's SIGHUP: as Ctrl-C
        return _run_and_report(a, opts, found, devices)


def _refuse_moot(a: argparse.Namespace) -> None:
    """An option another makes moot is refused, never ignored."""
    given = getattr(a, "given", ())
    no_controls = a.self_control == "none"
    moot = (
        ("--cache-keep", "cache_keep" in given and a.no_cache, "--no-cache keeps no cache"),
        (
            "--self-control-attempts",
            "self_control_attempts" in given and no_controls,
            "--self-control none runs no self control",
        ),
        (
            "--name-control-kernels",
            "name_control_kernels" in given and no_controls,
            "--self-control none runs no self control",
        ),
        ("--out", a.out is not None and a.dry_run, "--dry-run only lists the case ids, writing nothing"),
    )
    for flag, refused, why in moot:
        if refused:
            raise ConfigError(f"{flag} would be ignored: {why}; give one of the two")


def _judge_options(a: argparse.Namespace) -> _Options:
    """Every flag's value judged, and the folders it names, before the builds are looked for (no build, no GPU:
    exit 4 only after a bad flag would have been refused)."""
    from repro.vllm_integration.gate import dynamic_k  # as above
    from repro.vllm_integration.gate.cache import CACHE_ENV  # the gate's modules load only for it
    from repro.vllm_integration.gate.case import persons_choices  # as above
    from repro.vllm_integration.gate.keep import keep_seconds  # as above
    from repro.vllm_integration.gate.launch import launcher_kind  # as above
    from repro.vllm_integration.gate.modes import PLAIN, parse_backends, parse_modes  # as above
    from repro.vllm_integration.gate.paths import parse_paths  # as above
    from repro.vllm_integration.plugin.inject import STALE_K  # as above

    _refuse_moot(a)
    modes, backends = parse_modes(a.modes), parse_backends(a.backends)
    if STALE_K in a.forms and not any(dynamic_k.base_of(m) for m in a.methods):
        raise ConfigError(
            "--self-control-forms stale-k would be ignored: it is the dynamic-K methods' own form (added for them), "
            f"and none of --methods {','.join(a.methods)} is one"
        )
    if a.name_control_kernels and (a.compare_paths or PLAIN not in modes):
        why = "--compare-paths runs its paths without it" if a.compare_paths else "no plain mode in --modes"
        raise ConfigError(
            f"--name-control-kernels would be ignored: {why} (a self control's plain crash is what it reruns)"
        )
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
    check_folder(a.out, a.overwrite)
    check_out_dir(a.logs, "--logs")
    check_out_dir(a.cache_dir, "--cache-dir")
    if a.cache_dir is None and not (a.no_cache or a.compare_paths) and os.environ.get(CACHE_ENV):
        check_out_dir(os.environ[CACHE_ENV], CACHE_ENV)  # where the cache goes by default: judged as --cache-dir
    return _Options(modes, backends, keep, paths)


def _find_builds(a: argparse.Namespace) -> _Builds:
    """The builds: the installed vllm (unless --no-installed; --installed-label names it), --vllm and --control,
    the overlays (judged here, made once the cases can run), each with its torch; labels distinct; no input of the
    run inside --out."""
    from repro.vllm_integration.gate.cache import default_root  # the gate's modules load only for it
    from repro.vllm_integration.releases.builds import (  # as above  # as above
        CONTROL,
        UNDER_TEST,
        attach_torch,
        check_label,
        find_builds,
        parse_builds,
        parse_overlays,
    )

    overlays = parse_overlays(a.overlay)
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
    return _Builds(builds, overlays, overlay_torch)


def _cannot_run(why: str, no_gpu: str | None) -> int:
    """The one line that says the gate cannot run here (exit 4), with what to do without a GPU where none is seen."""
    tail = "" if no_gpu is None else f"{no_gpu} (without a GPU: `python -m repro vllm-check` reads a build's sources)"
    print(f"repro: cannot run here: {why}{tail}", file=sys.stderr)
    return exit_codes.Exit.NOT_RUN


def _dry_run(a: argparse.Namespace, opts: _Options, found: _Builds) -> int:
    """`--dry-run`: every case id the run would start, one a line on stdout; each case of a method its build lacks
    on stderr with the reason (the run starts no process for it); nothing written."""
    from repro.vllm_integration.gate.case import plan  # the gate's modules load only for it
    from repro.vllm_integration.gate.process import set_apart_not_applicable  # as above

    listed = found.builds + [o.listed() for o in found.overlays]
    cases = plan(listed, opts.modes, a.repeat, a.timeout, opts.backends, a.self_control, a.compile, a.methods, a.forms)
    # an overlay is made by the run: its files cannot be read yet, its cases are listed as they are
    runs, na = set_apart_not_applicable([c for c in cases if c.build.prefix is not None])
    runs = [c for c in cases if c.build.prefix is None or c in runs]
    for c in runs:
        print(c.case_id)
    for c, r in na:
        print(f"not applicable (no process): {c.case_id}: {r.not_applicable}", file=sys.stderr)
    under = {c.build.label for c, _ in na if not c.is_control} - {c.build.label for c in runs if not c.is_control}
    for label in sorted(under):
        print(f"gate --dry-run: none of the methods asked for applies to build {label}: the run would answer "
              "CANNOT VOUCH", file=sys.stderr)  # fmt: skip
    return exit_codes.Exit.OK


def _progress(c, r) -> None:
    """A line per finished case, as the run reports it."""
    said = "" if r.evidence == r.reason else f"{r.evidence or ''} "  # a not-applicable case's reason is its evidence
    print(f"[gate] {c.case_id}: {r.verdict} ({r.wall_s:.0f} s) {said}{r.reason[:160]}", flush=True)


def _run_and_report(a: argparse.Namespace, opts: _Options, found: _Builds, devices: list) -> int:
    """The GPU checked, the report folder opened, the overlays made, the cases run (or --compare-paths), the run
    judged once and its reports written; the exit code from that one judgment."""
    from repro.report.environment import collect  # the gate's modules load only for it
    from repro.run.memory import gpu_memory_gib  # as above
    from repro.vllm_integration.gate import report as gate_report  # as above
    from repro.vllm_integration.gate.placement import cold_jobs, cpu_cores, fit_jobs  # as above
    from repro.vllm_integration.gate.run import run_gate  # as above
    from repro.vllm_integration.releases.builds import make_overlays, needs_gpu  # as above

    builds = found.builds
    gpu = gpu_present()  # probed in a child process, and not cached when there is no GPU: once here
    if not gpu and (found.overlays or needs_gpu(builds)):  # an overlay holds its base's compiled extensions
        return _cannot_run("no CUDA GPU visible, and vLLM's cases run on one", "")
    # only builds without compiled extensions get here without a GPU: stand-ins (tests/fake_vllm.py); the reports say
    # so under their headline too: a PASS here vouches for no real vLLM
    stand_ins = "these builds have no compiled extensions (stand-ins?); their answer says nothing about a real vLLM"
    caveat = {} if gpu else {gate_report.NO_GPU: stand_ins}
    if caveat:
        print(f"[gate] no CUDA GPU: {caveat[gate_report.NO_GPU]}", file=sys.stderr)
    out = open_folder(a.out, "gate", a.overwrite)
    if found.overlays:
        dest = out / "overlays" if a.out else Path(tempfile.mkdtemp(prefix="repro-overlays-"))
        builds += make_overlays(found.overlays, dest, builds, found.overlay_torch)
    logs = Path(a.logs) if a.logs else out / "logs"
    cold = None  # fitted: half the cores on a build's cold caches (placement.ColdSlots); `--jobs N`: N everywhere
    if a.jobs is None:
        a.jobs, why = fit_jobs(cpu_cores(), gpu_memory_gib(), len(devices) or 1)
        cold = cold_jobs(cpu_cores())
        print(f"[gate] cases at a time: {why} (--jobs to choose)", flush=True)
    if a.compare_paths:
        return _compare_paths(a, opts, builds, out, logs)
    how = dict(
        devices=devices, launcher=a.launcher, deadline_s=a.deadline, compile=a.compile, keep_forkserver=opts.keep
    )
    how |= dict(methods=a.methods, self_control_attempts=a.self_control_attempts, self_control_forms=a.forms)
    how |= dict(cold_jobs=cold, control_kernels=a.name_control_kernels)
    cache = _cache(a, builds)
    run = run_gate(
        builds, opts.modes, logs, a.repeat, a.jobs, a.timeout, _progress, cache, opts.backends, a.self_control, **how
    )
    run.setup_s = round(run.started_at - command_started_at(), 2)  # CLI, build discovery, its GPU check
    judgment = run.judge(need_control=not a.no_control)  # the one decision: the reports and the exit code read it
    env = collect() | caveat
    run.command_s = round(time.time() - command_started_at(), 1)  # before its reports, its environment collected
    written = gate_report.write(run, out, env)
    print(gate_report.markdown(run, env, terminal=True))  # verdicts.md's lines up to its per-case tables
    print(f"written: {', '.join(str(p) for p in written)}")
    return exit_codes.gate(judgment.outcome)


def _cache(a: argparse.Namespace, builds: list):
    """The gate's cache (None with --no-cache), its build folders unused longest pruned (--cache-keep, its age)."""
    from repro.vllm_integration.gate.cache import GateCache, default_root  # the gate's modules load only for it

    if a.no_cache:
        return None
    cache = GateCache(Path(a.cache_dir) if a.cache_dir else default_root())
    if removed := cache.prune(a.cache_keep, a.cache_max_age_days, protect=builds):
        print(f"[gate] cache: removed {len(removed)} build folder(s) unused longest: {', '.join(map(str, removed))}")
    return cache


def _compare_paths(a: argparse.Namespace, opts: _Options, builds, out: Path, logs: Path) -> int:
    """`gate --compare-paths`: old path, new path cold, new path warm; each path's gate report in OUT/<path>/,
    the side-by-side table in OUT/paths.md and paths.json. Exit: the last path's gate exit code, or 3 when a case's
    answer differs between the paths (the new path cannot stand in for the old)."""
    from repro.vllm_integration.gate.paths import compare_paths, write_comparison  # the gate's modules: only for it

    cache_root = Path(a.cache_dir) if a.cache_dir else out / "cache"
    how = (a.jobs, a.timeout, _progress, opts.backends, opts.paths, a.self_control, a.compile)
    runs = compare_paths(builds, opts.modes, logs, cache_root, *how)
    differ = write_comparison(runs, out, need_control=not a.no_control)
    return exit_codes.compare_paths(differ, list(runs.values())[-1].judged().outcome)  # judged in write_comparison
