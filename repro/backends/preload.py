"""Imported once by the forkserver (repro.run.executor) before it forks any case: loads the FA3 libraries this
environment names and hashes them, without touching CUDA, so a forked case finds them loaded and hashed. A library
that fails to load here is left alone: the case that needs it reports why."""

from __future__ import annotations

import contextlib
import importlib.util
import os

from repro.backends import load_backend
from repro.backends.upstream import ENV_VAR as UPSTREAM_ENV
from repro.backends.vllm_fork import find_vllm_libs


def preload() -> list[str]:
    """Names of the backends loaded (upstream when its folder is named or flash_attn_3 is installed; vllm only for a
    library path in the environment: importing the vllm package is not worth its time in a case)."""
    wanted, loaded = [], []
    if os.environ.get(UPSTREAM_ENV) or importlib.util.find_spec("flash_attn_3") is not None:
        wanted.append("upstream")
    if find_vllm_libs():
        wanted.append("vllm")
    for name in wanted:
        with contextlib.suppress(Exception):
            load_backend(name).identity()
            loaded.append(name)
    return loaded


preload()
