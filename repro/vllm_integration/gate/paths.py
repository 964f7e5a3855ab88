"""The paths a vLLM gate run can take, and `gate --compare-paths`, which runs several of them one after the other in
one command so their time and verdicts stand side by side (repro.vllm_integration.gate.bench writes the table):

  old          no cache (every case cold, every reference run), every case process spawned
  new (cold)   the gate cache (repro.vllm_integration.gate.cache) on an empty folder, spawned case processes
  new (warm)   the same cache again, on what the cold run left
  fork (cold)  the gate cache on an empty folder of its own, case processes forked from each build's forkserver
               (repro.vllm_integration.gate.launch)
  fork (warm)  that cache again, forked
  kept (cold)  the gate cache on an empty folder of its own, forked from forkservers this path starts and keeps
               (repro.vllm_integration.gate.keep, KEPT_IDLE_S)
  kept (warm)  that cache again, forked from the forkservers the cold kept path left: no import before a case

The default is the first five; the kept paths are asked for by name (`--paths ...,kept-cold,kept-warm`).
A warm path needs its cold one before it. Each path's logs go to a sub-folder of its own (path_folder)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from repro.case.spec import CaseResult
from repro.errors import ConfigError
from repro.files import write_whole
from repro.vllm_integration.gate.cache import GateCache
from repro.vllm_integration.gate.case import DEFAULT_BACKEND, GateCase
from repro.vllm_integration.gate.launch import FORK, SPAWN
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.outcome import GateRun
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.gate.worker import DEFAULT_COMPILE
from repro.vllm_integration.releases.builds import VllmBuild

OLD_PATH, NEW_COLD, NEW_WARM = "old", "new (cold)", "new (warm)"
FORK_COLD, FORK_WARM = "fork (cold)", "fork (warm)"
KEPT_COLD, KEPT_WARM = "kept (cold)", "kept (warm)"
PATHS = (OLD_PATH, NEW_COLD, NEW_WARM, FORK_COLD, FORK_WARM, KEPT_COLD, KEPT_WARM)
DEFAULT_PATHS = PATHS[:5]
KEPT_IDLE_S = 120.0  # the kept paths' forkservers: long enough for the warm path to find them, then they idle out
# path -> (its cache folder under the comparison's cache root, None: no cache; its launcher; its forkservers kept, s)
HOW = {
    OLD_PATH: (None, SPAWN, None),
    NEW_COLD: (".", SPAWN, None),
    NEW_WARM: (".", SPAWN, None),
    FORK_COLD: ("fork-path", FORK, None),
    FORK_WARM: ("fork-path", FORK, None),
    KEPT_COLD: ("kept-path", FORK, KEPT_IDLE_S),
    KEPT_WARM: ("kept-path", FORK, KEPT_IDLE_S),
}
WARM_NEEDS = {NEW_WARM: NEW_COLD, FORK_WARM: FORK_COLD, KEPT_WARM: KEPT_COLD}


def path_folder(name: str) -> str:
    """The folder name of a path's logs and report: old, new-cold, new-warm, fork-cold, fork-warm, kept-cold, ..."""
    return name.replace(" ", "").replace("(", "-").replace(")", "")


def compare_paths(
    builds: list[VllmBuild],
    modes: tuple[GateMode, ...],
    log_dir: str | Path,
    cache_root: str | Path,
    jobs: int = 3,
    timeout_s: float = 300.0,
    progress: Callable[[GateCase, CaseResult], None] | None = None,
    backends: tuple[str, ...] = (DEFAULT_BACKEND,),
    paths: tuple[str, ...] = DEFAULT_PATHS,
    self_control: str = "under-test",
    compile: str = DEFAULT_COMPILE,
) -> dict[str, GateRun]:
    """The same gate on each path of `paths`, in the order of PATHS. cache_root must be empty or absent: a cold
    run is only cold there (the fork paths keep their cache in a folder of their own under it)."""
    cache_root = Path(cache_root)
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths or any(w in paths and c not in paths for w, c in WARM_NEEDS.items()):
        raise ConfigError(f"paths {list(paths)}: pick from {list(PATHS)}; a warm run needs its cold one before it")
    if cache_root.exists() and any(cache_root.iterdir()):
        raise ConfigError(f"{cache_root}: the cold run needs an empty cache folder")
    runs = {}
    for name in (p for p in PATHS if p in paths):
        folder, launcher, keep_s = HOW[name]
        cache = None if folder is None else GateCache(cache_root / folder)
        sub = Path(log_dir) / path_folder(name)
        runs[name] = run_gate(
            builds,
            modes,
            sub,
            1,
            jobs,
            timeout_s,
            progress,
            cache,
            backends,
            self_control,
            launcher=launcher,
            compile=compile,
            keep_forkserver=keep_s,
        )
    return runs


def parse_paths(text: str | None, compare: bool) -> tuple[str, ...]:
    """`gate --paths`: the paths --compare-paths runs, in order (PATHS by folder name); refused without it."""
    if text is not None and not compare:
        raise ConfigError(f"--paths {text}: picks the paths of --compare-paths; give --compare-paths too")
    by_folder = {path_folder(p): p for p in PATHS}
    default = ",".join(path_folder(p) for p in DEFAULT_PATHS)
    asked = [x.strip() for x in (text or default).split(",") if x.strip()]
    if not asked or any(x not in by_folder for x in asked) or len(set(asked)) != len(asked):
        raise ConfigError(f"--paths {text}: pick each from {', '.join(by_folder)} at most once")
    return tuple(by_folder[x] for x in asked)


def write_comparison(runs: dict[str, GateRun], out: Path, need_control: bool) -> bool:
    """Each path's run judged once for the question asked (need_control: False for --no-control), then its gate
    report in OUT/<path>/, the side-by-side table in OUT/paths.md and paths.json (each reads that one answer), the
    table's head printed. Returns whether a case's answer differs between the paths."""
    from repro.report import results as report  # the reports' modules: only when a comparison ran
    from repro.report.environment import collect  # as above
    from repro.report.redact import redact  # as above
    from repro.vllm_integration.gate import bench as gate_bench  # as above
    from repro.vllm_integration.gate import report as gate_report  # as above

    env = collect()
    for name, run in runs.items():
        run.judge(need_control)
        gate_report.write(run, out / path_folder(name), env)
    md = gate_bench.compare_markdown(runs)
    write_whole(out / "paths.md", redact("\n".join(report.header("vLLM gate: old and new path", env))) + "\n" + md)
    write_whole(out / "paths.json", json.dumps({"environment": env, "paths": gate_bench.compare_json(runs)}, indent=1))
    print(md.split("### Phases")[0])
    differ = bool(gate_bench.verdict_diff(gate_bench.path_verdicts(runs)))
    if differ:
        print("repro: the paths' answers differ (listed in paths.md): the new path cannot stand in for the old")
    else:
        print(f"written: {out / 'paths.md'}, {out / 'paths.json'}")
    return differ
