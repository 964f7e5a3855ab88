"""The gate's use of the harness's one forkserver (repro.run.forkserver, repro.run.forkclient): one per vLLM build,
which imports torch, vLLM and the harness's plugin modules (PRELOAD) once, without starting CUDA, and forks one gate
case process per request (repro.vllm_integration.gate.launch decides which). What is the gate's own: the variables
that differ per case (LATE_VARS), the build's site folders added before the imports (builds.add_site_dirs), the checks
that refuse a forkserver vLLM's imports made unfit to fork cases from (problems), and where a kept one listens
(repro.vllm_integration.gate.keep)."""

from __future__ import annotations

import sys
from pathlib import Path

from repro import entrypoints
from repro.contract import request
from repro.contract.channel import ENV as CHANNEL_ENV
from repro.errors import ConfigError
from repro.run import forkclient, kept
from repro.run.forkclient import ForkServer
from repro.vllm_integration.gate import keep as gate_keep

TARGET_MAIN = entrypoints.GATE_WORKER + ":main"  # what a gate case process runs
PRELOAD = entrypoints.GATE_PRELOAD  # what a case process imports before its engine starts
LATE_VARS = frozenset(
    {
        "CUDA_VISIBLE_DEVICES",  # read when CUDA starts (placement)
        "CUDA_MPS_PIPE_DIRECTORY",  # MPS client: read when CUDA starts
        "CUDA_MPS_LOG_DIRECTORY",
        "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_LAUNCH_BLOCKING",  # the attribution rerun: read when the CUDA context is made
        "VLLM_CACHE_ROOT",  # vllm.envs reads it when asked (the model registry, torch.compile), not at import
        "TRITON_CACHE_DIR",  # read when a kernel compiles (vLLM's compile and JIT warmup), not at import
        CHANNEL_ENV,  # read at each record
        request.ENV,  # the case's request: read by the worker's main and by plugin.register when vLLM loads it
    }
)
KEPT_LATE = frozenset({"CUDA_VISIBLE_DEVICES"})  # the same for every case of a run without --devices: kept
CASE_DEFAULTS = {"VLLM_USE_V2_MODEL_RUNNER": "1"}  # as the worker's __main__ sets them, when the case's env has none


def launch_env(env: dict[str, str]) -> dict[str, str]:
    """A forkserver's environment: a case's, less what differs per case (KEPT_LATE kept as the case has it)."""
    return forkclient.launch_env(env, LATE_VARS, KEPT_LATE)


def differs(env: dict[str, str], launch: dict[str, str], read_at_import=()) -> list[str]:
    """The variables in which a case's environment differs from its forkserver's (forkclient.differs, LATE_VARS)."""
    return forkclient.differs(env, launch, LATE_VARS, read_at_import)


def problems() -> list[str]:
    """Called in the forkserver after its imports (its --checks): what vLLM's imports did that makes it unfit to fork
    gate cases from."""
    out = []
    envs = sys.modules.get("vllm.envs")
    if envs is not None:
        getter = vars(envs).get("__getattr__")
        if hasattr(getter, "__wrapped__") or vars(envs).get("_env_cache") is not None:
            out.append("vLLM's environment cache is on (enable_envs_cache): a case's variables would not be read")
    plugins = sys.modules.get("vllm.plugins")
    if plugins is not None and vars(plugins).get("plugins_loaded"):
        out.append("vLLM loaded its general plugins while importing: the plugin would not see a case's environment")
    counters = sys.modules.get(entrypoints.PLUGIN_COUNTERS)
    if counters is not None and getattr(counters, "_installed", None):
        out.append(f"the plugin installed {sorted(counters._installed)} in the forkserver")
    return out


class GateForkServer(ForkServer):
    """A build's forkserver: the harness's one, started with the gate's per-case variables, setup and checks."""

    def __init__(
        self,
        label: str,
        env: dict[str, str],
        log_path: Path,
        preload: tuple[str, ...],
        keep_s: float | None = None,
        identity: str = "",
    ) -> None:
        launch = launch_env(env)
        socket, failed = None, None
        if keep_s:
            try:
                socket = kept.socket_for(gate_keep.socket_dir(), label, launch, preload, LATE_VARS, identity)
            except (ConfigError, OSError) as e:  # no folder of this user's alone: its cases are launched plainly
                failed = f"not kept: {e}"
        super().__init__(
            label,
            launch,
            log_path,
            preload,
            LATE_VARS,
            frozenset({TARGET_MAIN}),
            setup=entrypoints.GATE_FORK_SETUP,
            checks=entrypoints.GATE_FORK_CHECKS,
            socket=socket,
            keep_s=keep_s,
            unavailable=failed,
        )

    def run(self, target, argv, env, out_path, timeout_s, stall=None):
        return super().run(target, argv, {**CASE_DEFAULTS, **env}, out_path, timeout_s, stall)
