"""Where a gate case's Triton kernels go (TRITON_CACHE_DIR): on the cache path the build's one folder, shared by its
cold and warm cases alike; without the cache the case's own folder, removed with it; never the user's ~/.triton,
where vLLM sends a case that loads its compiled artifacts when the variable is unset (measured on the H200:
results/h200-paths-inductor-0.34.0, JIT warmup 37 s in a warm spawned case that found ~/.triton cold)."""

from __future__ import annotations

from pathlib import Path

import pytest

from repro.vllm_integration.gate.cache import TRITON_CACHE, TRITON_ENV, GateCache
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.forkserver import LATE_VARS, differs
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.process import run_case
from repro.vllm_integration.releases.builds import UNDER_TEST, parse_builds
from tests.fake_vllm import write_fake_vllm


class _Seen(Exception):
    pass


class _Recorder:
    """A launcher that records each case's environment and starts nothing."""

    def __init__(self) -> None:
        self.envs: list[dict[str, str]] = []

    def launch(self, case, cmd, env, log_dir, sanitized, run_process):
        self.envs.append(dict(env))
        raise _Seen


def _env_of(case: GateCase, builds, log_dir: Path, cache: GateCache | None) -> dict[str, str]:
    rec = _Recorder()
    with pytest.raises(_Seen):
        run_case(case, builds, log_dir, cache=cache, launcher=rec)  # type: ignore[arg-type]
    return rec.envs[0]


def test_every_case_of_a_build_shares_its_triton_folder_on_the_cache_path_and_none_uses_home(tmp_path, monkeypatch):
    monkeypatch.setenv(TRITON_ENV, str(tmp_path / "home-triton"))  # what the gate's own environment says is replaced
    build = parse_builds(f"b={write_fake_vllm(tmp_path / 'b', '0.26.0', 'good')}", UNDER_TEST, "REPRO_VLLM")[0]
    cache = GateCache(tmp_path / "cache")
    envs = [_env_of(GateCase(build, GateMode.parse(m)), [build], tmp_path / "logs", cache) for m in ("audit", "plain")]
    want = cache.build_dir(build) / TRITON_CACHE
    assert [e[TRITON_ENV] for e in envs] == [str(want)] * 2 and want.is_dir()
    old = _env_of(GateCase(build, GateMode.parse("plain")), [build], tmp_path / "old", None)
    assert Path(old[TRITON_ENV]).parent == Path(old["VLLM_CACHE_ROOT"])  # the old path: the case's own, cold
    assert str(tmp_path / "home-triton") not in {e[TRITON_ENV] for e in (*envs, old)}


def test_a_case_with_its_own_triton_folder_is_still_forked():
    """The variable differs per case on the old path: it is read when a kernel compiles, after the import, so it is
    one of the forkserver's late variables and never a reason to launch a case plainly."""
    assert TRITON_ENV in LATE_VARS
    assert differs({TRITON_ENV: "/a", "PATH": "/bin"}, {TRITON_ENV: "/b", "PATH": "/bin"}) == []
    assert differs({TRITON_ENV: "/a"}, {TRITON_ENV: "/b"}, read_at_import=[TRITON_ENV]) == [TRITON_ENV]
