"""A process holds one build of an FA3 library: a case forked from a server that preloaded another build than the one
the case names is refused with the reason, never run on the preloaded kernels under the named build's identity."""

from __future__ import annotations

import sys
import types

import pytest

from repro.backends.base import same_library
from repro.errors import BackendUnavailable


def test_the_same_file_under_another_name_is_the_same_library(tmp_path):
    lib = tmp_path / "_vllm_fa3_C.abi3.so"
    lib.write_bytes(b"x")
    (tmp_path / "link.so").symlink_to(lib)
    same_library(tmp_path / "link.so", lib, "vLLM's FA3")
    same_library(None, lib, "vLLM's FA3")  # nothing loaded yet
    other = tmp_path / "other.so"
    other.write_bytes(b"y")
    with pytest.raises(BackendUnavailable, match=r"already loaded vLLM's FA3 from .*other\.so, not .*_vllm_fa3_C"):
        same_library(other, lib, "vLLM's FA3")


def test_upstream_from_another_folder_than_the_preloaded_one_is_refused(tmp_path, monkeypatch):
    from repro.backends.upstream import UpstreamFa3

    preloaded, wanted = tmp_path / "a", tmp_path / "b"
    for root in (preloaded, wanted):
        (root / "flash_attn_3").mkdir(parents=True)
    mod = types.ModuleType("flash_attn_3")
    mod.__file__ = str(preloaded / "flash_attn_3" / "__init__.py")
    monkeypatch.setitem(sys.modules, "flash_attn_3", mod)
    with pytest.raises(BackendUnavailable, match=r"already loaded upstream FA3 from .*/a, not .*/b"):
        UpstreamFa3(str(wanted))
    with pytest.raises(BackendUnavailable) as same:  # the preloaded folder itself: on to the import (no _C here)
        UpstreamFa3(str(preloaded))
    assert "already loaded" not in str(same.value)


def test_the_loaded_vllm_library_is_found_by_its_name():
    from repro.backends.vllm_fork import _loaded_lib

    fake = types.SimpleNamespace(ops=types.SimpleNamespace(loaded_libraries={"/x/libother.so", "/y/_vllm_fa3_C.so"}))
    assert _loaded_lib(fake) == "/y/_vllm_fa3_C.so"
    assert _loaded_lib(types.SimpleNamespace(ops=types.SimpleNamespace(loaded_libraries=set()))) is None
