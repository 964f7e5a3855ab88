"""Every project module named as a string, in one place: the modules a process is started as (`python -m ...`), the
modules a process imports by name before it serves (the preload lists), the module a forked process runs, and the
module sources a kept reference's key hashes. No other module of repro/ names a project module as a string or imports
one by name; tests/test_architecture.py checks that, and counts each name here as an import by the module that uses
it, so that an import circle through a process start or a by-name import is found like any other. It imports no
project module, and sits at the bottom of the layers."""

from __future__ import annotations

import importlib
import importlib.util
import sys

ATTENTION_WORKER = "repro.attention.worker"  # one attention-layer case (python -m, or main() in a forked process)
ATTENTION_WORKER_MAIN = ATTENTION_WORKER + ":main"
SPEC_WORKER = "repro.specdecode.worker"  # one spec-decode case (the scenario SPEC), the same way
SPEC_WORKER_MAIN = SPEC_WORKER + ":main"
BACKENDS_PRELOAD = "repro.backends.preload"  # the FA3 libraries, loaded and hashed once in a forkserver
EXECUTOR = "repro.run.executor"  # a warm process under memcheck (`python -m repro.run.executor warm`)
FORKSERVER = "repro.run.forkserver"  # the harness's one forkserver (`python -m repro.run.forkserver`)
CHANNEL = "repro.contract.channel"
PLUGIN = "repro.vllm_integration.plugin"
PLUGIN_COUNTERS = "repro.vllm_integration.plugin.counters"  # the plugin's counters, looked up if it was imported
GATE_WORKER = "repro.vllm_integration.gate.worker"  # one gate case (python -m, or main() in a forked process)
GATE_FORK_SETUP = "repro.vllm_integration.releases.builds:add_site_dirs"  # a gate forkserver's --setup
GATE_FORK_CHECKS = "repro.vllm_integration.gate.forkserver:problems"  # and its --checks
BISECT = "repro.vllm_integration.releases.bisect"  # `git bisect run`'s step

# what the attention layer's forkserver, warm processes and server import before their first case
EXECUTOR_PRELOAD = ("torch", ATTENTION_WORKER, BACKENDS_PRELOAD)
# what a gate case process imports before its engine starts: torch, vLLM's LLM and SamplingParams (gate.main), the
# channel and the plugin vLLM loads through its entry point (not registered there: that is the case's, with its
# environment), the gate module itself ("module:attribute" names an attribute read after the import)
GATE_PRELOAD = ("torch", "vllm", "vllm:LLM", "vllm:SamplingParams", CHANNEL, PLUGIN, GATE_WORKER)
# The gate's model, prompts and weights: a reference depends on their text. Each module's text is hashed under a
# label, the file's name when the key began, not under its place (repro.vllm_integration.gate.cache).
GATE_SOURCES = {
    "gate.py": GATE_WORKER,
    "plugin.py": PLUGIN,
    "backend_hooks.py": "repro.vllm_integration.plugin.backend_hooks",
    "capture.py": "repro.vllm_integration.plugin.capture",
    "counters.py": "repro.vllm_integration.plugin.counters",
    "fa3_hooks.py": "repro.vllm_integration.plugin.fa3_hooks",
    "metadata_views.py": "repro.vllm_integration.plugin.metadata_views",
    "weights.py": "repro.vllm_integration.plugin.weights",
}


def command(module: str, *args: str) -> list[str]:
    """`python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *args]


def load(name: str):
    """Import a module by its name; "module:attribute" returns the attribute, read after the import."""
    module, _, attr = name.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, attr) if attr else mod


def source(module: str) -> str:
    """A module's file, found without importing it."""
    return str(importlib.util.find_spec(module).origin)
