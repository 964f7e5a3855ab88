"""End-to-end gate against an installed vLLM (marker vllm): V2 runner, EAGLE with 3 speculative tokens, FULL CUDA
graphs, FLASH_ATTN (FA3), with the freshness auditor. Skipped with the reason when vllm or a GPU is missing."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from cases.gpu_env import gpu_skip_reason
from repro.vllm_integration.gate import gate_env


@pytest.mark.gpu
@pytest.mark.vllm
def test_stale_metadata_vllm_gate(tmp_path, record_property):
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm); the gate runs vLLM's own V2 model runner")
    reason = gpu_skip_reason()
    if reason:
        pytest.skip(reason)
    audit = tmp_path / "audit.json"
    env = gate_env(os.environ, str(audit))
    r = subprocess.run(
        [sys.executable, "-m", "repro.vllm_integration.gate", "--out", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    record_property("returncode", r.returncode)
    assert audit.exists(), f"the auditor plugin did not run (is this package installed?): {r.stderr[-2000:]}"
    report = json.loads(audit.read_text())
    record_property("audit", report["summary"])
    assert report["checks"] > 0, "the auditor saw no forward: it cannot vouch for this build"
    assert r.returncode == 0, r.stderr[-3000:]
    assert not report["mismatches"], report["summary"]
