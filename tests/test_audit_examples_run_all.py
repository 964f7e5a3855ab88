"""scripts/audit_examples/run-all.sh, the GPU evidence for `repro audit`, through a stand-in python: every example
runs (JOBS at once), a mutant's commands import the mutant first, the overhead runs last alone, and an existing
report folder is refused before anything runs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "audit_examples" / "run-all.sh"
STAND_IN = """#!/bin/bash
case "$*" in *mutate_vllm.py*) mkdir -p "${@: -3:1}"; exit 0;; esac
echo "PYTHONPATH=${PYTHONPATH:-} MEM=${AUDIT_EXAMPLE_GPU_MEMORY:-} ARGS: $*"
"""


def _run(tmp_path: Path, out: Path, jobs: str) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(STAND_IN)
    (bin_dir / "python").chmod(0o755)
    (tmp_path / "site" / "vllm").mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "PYTHONPATH": "/prefix/torch", "JOBS": jobs}
    env.pop("AUDIT_EXAMPLE_GPU_MEMORY", None)
    cmd = ["bash", str(SCRIPT), str(tmp_path / "site"), str(out)]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)


def test_every_example_runs_jobs_at_once_and_a_mutants_commands_import_the_mutant_first(tmp_path):
    out = tmp_path / "out"
    r = _run(tmp_path, out, "3")
    assert r.returncode == 0, r.stderr
    names = [line.split()[0] for line in (out / "exit-codes.txt").read_text().splitlines()]
    assert len(names) == len(set(names)) == 34 and names[-1] == "overhead"
    assert {"clean-serve", "clean-asked-eagle-ran-eagle3", "standalone-wrong-descriptor-strict"} <= set(names)
    mutant = (out / "dflash-wrong-descriptor-dflash.log").read_text()
    assert f"PYTHONPATH={out}/prefix-dflash-wrong-descriptor:/prefix/torch MEM=0.09" in mutant
    assert "--expect-method dflash" in mutant and "--timeout 400" in mutant
    assert "MEM=0.5" in (out / "overhead.log").read_text()  # alone on the GPU


def test_an_existing_report_folder_is_refused_before_anything_runs(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "kept").write_text("a report")
    r = _run(tmp_path, out, "1")
    assert r.returncode == 2 and sorted(p.name for p in out.iterdir()) == ["kept"]
