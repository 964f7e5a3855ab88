"""The gate's GPU memory per case process (placement.case_gib, run_gate's MemoryBudget): memcheck:own keeps a cudaMalloc
per tensor and every graph's memory, 12-14 GiB a process on the H200 (three times that with guards), where a plain
case takes about 4. Five gates at once there ran out of memory together (results/README.md); inside one gate the budget keeps the cases beside each other within the free memory."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from repro.case.spec import CaseResult
from repro.run import own_alloc
from repro.run.memory import GIB, MemoryBudget
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate.case import GateCase, reference_for
from repro.vllm_integration.gate.modes import GateMode, parse_modes
from repro.vllm_integration.gate.placement import GIB_MEMCHECK_OWN, GIB_MEMCHECK_OWN_GUARDED, GIB_PER_CASE, case_gib
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.releases.builds import CONTROL, UNDER_TEST, VllmBuild


def test_a_memcheck_own_case_is_budgeted_more_and_more_again_with_guards(monkeypatch):
    build = VllmBuild("b", "/nowhere", UNDER_TEST)
    own = GateCase(build, GateMode.parse("memcheck:own"))
    monkeypatch.delenv(own_alloc.GUARD_ENV, raising=False)
    assert case_gib(GateCase(build, GateMode.parse("plain"))) == GIB_PER_CASE
    assert case_gib(own) == GIB_MEMCHECK_OWN > GIB_PER_CASE
    assert case_gib(GateCase(build, GateMode.parse("memcheck:own+poison:int-max"))) == GIB_MEMCHECK_OWN
    assert case_gib(reference_for(own)) == GIB_PER_CASE  # a reference never runs under memcheck
    monkeypatch.setenv(own_alloc.GUARD_ENV, "1")
    assert case_gib(own) == GIB_MEMCHECK_OWN_GUARDED > GIB_MEMCHECK_OWN


def _stand_in(monkeypatch):
    """Every case process replaced by a 0.2 s stand-in that counts how many memcheck processes run at once."""
    lock, now, most = threading.Lock(), [0], [0]

    def process(case, cmd, env, log_dir, sanitizer, executor=None, target=None):
        with lock:
            now[0] += bool(sanitizer)
            most[0] = max(most[0], now[0])
        time.sleep(0.2)
        with lock:
            now[0] -= bool(sanitizer)
        return CaseResult.skipped(case, "stand-in"), ""

    monkeypatch.setattr(gate_process, "run_process", process)
    monkeypatch.setattr(
        own_alloc, "build", lambda folder=None, guard=False: Path(folder or "own-alloc") / "stand-in.so"
    )
    return most


@pytest.mark.parametrize("budget_gib, together", [(20, 1), (40, 2)])
def test_memcheck_own_cases_run_beside_each_other_only_as_far_as_the_budget_holds(
    monkeypatch, tmp_path, budget_gib, together
):
    monkeypatch.delenv(own_alloc.GUARD_ENV, raising=False)
    most = _stand_in(monkeypatch)
    build = VllmBuild("0.26.0", str(tmp_path / "prefix"), UNDER_TEST)
    budget = MemoryBudget(budget_gib * GIB)
    run = run_gate([build], parse_modes("memcheck:own"), tmp_path / "logs", jobs=4, memory=budget, launcher="spawn")
    assert len(run.cases) == 3  # the build and its self control in both forms, all under memcheck:own
    assert most[0] == together and budget.held == 0
    assert budget.worst <= budget.total


@pytest.mark.parametrize("control_kernels", [False, True], ids=["default", "name-control-kernels"])
def test_a_plain_control_holds_room_for_its_launch_blocking_rerun_beside_it(monkeypatch, tmp_path, control_kernels):
    """A known-bad build in plain is expected to crash: its CUDA_LAUNCH_BLOCKING=1 rerun starts at once beside it (two
    processes), so it holds twice a case's memory; a self control in plain too where its kernel is asked for
    (`--name-control-kernels`), else it starts no rerun and holds one case's, as everything else does."""
    _stand_in(monkeypatch)
    asked = []

    class Spy(MemoryBudget):
        def hold(self, nbytes):
            asked.append(nbytes / GIB)
            return super().hold(nbytes)

    builds = [
        VllmBuild("0.26.0", str(tmp_path / "good"), UNDER_TEST),
        VllmBuild("0.25.1", str(tmp_path / "bad"), CONTROL),
    ]
    kw = dict(jobs=4, memory=Spy(100 * GIB), launcher="spawn", control_kernels=control_kernels)
    run_gate(builds, parse_modes("plain"), tmp_path / "logs", **kw)
    # the build and both references hold one case's, the known-bad build two; its self control (both forms) two
    # where their kernel is asked for, else one
    twice = 3 if control_kernels else 1
    assert sorted(asked) == [GIB_PER_CASE] * (6 - twice) + [2 * GIB_PER_CASE] * twice
