"""FA3 backends: load one by name, or list what this machine has."""

from __future__ import annotations

from repro.backends.base import BackendIdentity, Fa3Backend
from repro.errors import BackendUnavailable, ConfigError

BACKENDS = ("upstream", "vllm")


def load_backend(name: str, path: str | None = None) -> Fa3Backend:
    """Load `upstream` or `vllm`; `path` is a folder (upstream) or a .so (vllm). Raises BackendUnavailable."""
    if name == "upstream":
        from repro.backends.upstream import UpstreamFa3  # by name only: the CPU model imports no GPU backend

        return UpstreamFa3(path)
    if name == "vllm":
        from repro.backends.vllm_fork import VllmFa3  # by name only, as above

        return VllmFa3(path)
    raise ConfigError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")


__all__ = ["BACKENDS", "BackendIdentity", "BackendUnavailable", "Fa3Backend", "load_backend"]
