"""vLLM's FA3 fork (torch.ops._vllm_fa3_C), from an installed vllm or a _vllm_fa3_C*.so path."""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys
from pathlib import Path

from repro.backends.base import BackendIdentity, TorchOpsBackend, file_sha256, same_library
from repro.backends.layout import VLLM
from repro.errors import BackendUnavailable

ENV_VAR = "FA3_VLLM_LIB"
_VERSIONED = re.compile(r"^FA3_VLLM_(\d+)_(\d+)_(\d+)_LIB$")


def find_vllm_libs() -> dict[str, str]:
    """Every vLLM FA3 library named by the environment: version -> path (FA3_VLLM_LIB is 'env')."""
    found = {f"{m[1]}.{m[2]}.{m[3]}": v for k, v in os.environ.items() if (m := _VERSIONED.match(k))}
    if os.environ.get(ENV_VAR):
        found["env"] = os.environ[ENV_VAR]
    return found


def _version_from_path(path: str) -> str:
    m = re.search(r"vllm[-_](\d+\.\d+\.\d+)", path)
    return m.group(1) if m else "unknown"


def _loaded_lib(torch) -> str | None:
    """The _vllm_fa3_C library this process loaded, where it can tell."""
    for path in getattr(torch.ops, "loaded_libraries", ()):
        if "_vllm_fa3_C" in os.path.basename(path):
            return path
    mod = sys.modules.get("vllm.vllm_flash_attn._vllm_fa3_C")
    return getattr(mod, "__file__", None)


class VllmFa3(TorchOpsBackend):
    name = "vllm"
    flavor = VLLM

    def __init__(self, lib: str | None = None) -> None:
        import torch  # torch only when the backend loads: naming and listing backends needs none

        if lib is None:
            libs = find_vllm_libs()
            lib = libs.get("env") or (sorted(libs.items())[-1][1] if libs else None)
        if lib is not None:
            if not Path(lib).is_file():
                raise BackendUnavailable(f"{lib}: no such file (expected vLLM's _vllm_fa3_C*.so)")
            if not hasattr(torch.ops._vllm_fa3_C, "fwd"):
                try:
                    torch.ops.load_library(lib)
                except OSError as e:
                    raise BackendUnavailable(f"cannot load {lib}: {e}") from e
            else:  # loaded before this case (a preloading server): the build it names, or none of it
                same_library(_loaded_lib(torch), lib, "vLLM's FA3")
            version, package = _version_from_path(lib), "vllm (library path)"
        else:
            try:
                import vllm.vllm_flash_attn._vllm_fa3_C as ext  # noqa: F401  vLLM only when no library path is given
            except ImportError as e:
                raise BackendUnavailable(
                    f"vLLM FA3 not importable ({e}); pip install vllm or set {ENV_VAR}=path/to/_vllm_fa3_C.abi3.so"
                ) from e
            lib = ext.__file__ or ""
            version, package = md.version("vllm"), "vllm"
        self._ops = torch.ops._vllm_fa3_C
        self._identity = BackendIdentity("vllm", package, version, Path(lib).name, file_sha256(lib))
