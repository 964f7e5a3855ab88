"""The paths a vLLM gate run can take, and `gate --compare-paths`, which runs several of them one after the other in
one command so their time and verdicts stand side by side (repro.vllm_integration.gate.bench writes the table):

  old          no cache (every case cold, every reference run), every case process spawned
  new (cold)   the gate cache (repro.vllm_integration.gate.cache) on an empty folder, spawned case processes
  new (warm)   the same cache again, on what the cold run left
  fork (cold)  the gate cache on an empty folder of its own, case processes forked from each build's forkserver
               (repro.vllm_integration.gate.launch)
  fork (warm)  that cache again, forked

A warm path needs its cold one before it. Each path's logs go to a sub-folder of its own (path_folder)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from repro.case.spec import CaseResult
from repro.errors import ConfigError
from repro.vllm_integration.gate.cache import GateCache
from repro.vllm_integration.gate.case import DEFAULT_BACKEND, GateCase, GateMode
from repro.vllm_integration.gate.launch import FORK, SPAWN
from repro.vllm_integration.gate.run import GateRun, run_gate
from repro.vllm_integration.gate.worker import DEFAULT_COMPILE
from repro.vllm_integration.releases.builds import VllmBuild

OLD_PATH, NEW_COLD, NEW_WARM = "old", "new (cold)", "new (warm)"
FORK_COLD, FORK_WARM = "fork (cold)", "fork (warm)"
PATHS = (OLD_PATH, NEW_COLD, NEW_WARM, FORK_COLD, FORK_WARM)
# path -> (its cache folder under the comparison's cache root, None: no cache; its launcher)
HOW = {
    OLD_PATH: (None, SPAWN),
    NEW_COLD: (".", SPAWN),
    NEW_WARM: (".", SPAWN),
    FORK_COLD: ("fork-path", FORK),
    FORK_WARM: ("fork-path", FORK),
}
WARM_NEEDS = {NEW_WARM: NEW_COLD, FORK_WARM: FORK_COLD}


def path_folder(name: str) -> str:
    """The folder name of a path's logs and report: old, new-cold, new-warm, fork-cold, fork-warm."""
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
    paths: tuple[str, ...] = PATHS,
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
        folder, launcher = HOW[name]
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
        )
    return runs


def parse_paths(text: str | None, compare: bool) -> tuple[str, ...]:
    """`gate --paths`: the paths --compare-paths runs, in order (PATHS by folder name); refused without it."""
    if text is not None and not compare:
        raise ConfigError(f"--paths {text}: picks the paths of --compare-paths; give --compare-paths too")
    by_folder = {path_folder(p): p for p in PATHS}
    asked = [x.strip() for x in (text or ",".join(by_folder)).split(",") if x.strip()]
    if not asked or any(x not in by_folder for x in asked) or len(set(asked)) != len(asked):
        raise ConfigError(f"--paths {text}: pick each from {', '.join(by_folder)} at most once")
    return tuple(by_folder[x] for x in asked)
