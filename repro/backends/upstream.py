"""Upstream FlashAttention-3 (torch.ops.flash_attn_3), e.g. from PyPI tokenspeed-fa3 or a folder."""

from __future__ import annotations

import importlib
import importlib.metadata as md
import os
import sys
from pathlib import Path

from repro.backends.base import BackendIdentity, TorchOpsBackend, file_sha256, same_library
from repro.backends.layout import UPSTREAM
from repro.errors import BackendUnavailable

ENV_VAR = "FA3_UPSTREAM_PATH"


class UpstreamFa3(TorchOpsBackend):
    name = "upstream"
    flavor = UPSTREAM

    def __init__(self, path: str | None = None) -> None:
        path = path or os.environ.get(ENV_VAR)
        if path:
            if not Path(path, "flash_attn_3").is_dir():
                raise BackendUnavailable(f"{path}: no flash_attn_3/ folder (set {ENV_VAR} to a tokenspeed-fa3 tree)")
            loaded = sys.modules.get("flash_attn_3")
            if loaded is not None:  # imported before this case (a preloading server): from this folder, or none
                pkg_dir = (
                    Path(loaded.__file__).parent
                    if getattr(loaded, "__file__", None)
                    else Path(next(iter(getattr(loaded, "__path__", [])), "."))
                )
                same_library(pkg_dir.parent, path, "upstream FA3")
            sys.path.insert(0, str(path))
        try:
            import torch  # torch only when the backend loads: naming and listing backends needs none

            mod = importlib.import_module("flash_attn_3._C")
        except (ImportError, OSError) as e:
            raise BackendUnavailable(
                f"upstream FA3 not importable ({e}); pip install tokenspeed-fa3 or set {ENV_VAR}"
            ) from e
        self._ops = torch.ops.flash_attn_3
        lib = Path(mod.__file__ or "")
        version = "unknown"
        package = "local folder" if path else "flash_attn_3"
        for dist in ("tokenspeed-fa3", "flash-attn-3", "flash_attn_3"):
            try:
                version = md.version(dist)
                package = dist
                break
            except md.PackageNotFoundError:
                continue
        if path and version == "unknown":
            version = Path(path).name
        self._identity = BackendIdentity("upstream", package, version, lib.name, file_sha256(lib))
