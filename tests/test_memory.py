"""GPU memory as a budget the matrix's case processes hold (repro.run.memory): cases whose KV caches are large run
fewer at a time (`--max-model-len 131072` at the default jobs put 8 of 16 cases in CUDA out of memory on the
H200), a case larger than the budget runs alone, and without a GPU there is no limit."""

from __future__ import annotations

import threading
import time

from repro.case.descriptors import AttnConfig
from repro.case.matrix import MatrixOptions, build_specs
from repro.case.spec import CaseResult
from repro.contract.verdicts import CLEAN
from repro.run import runner
from repro.run.matrix import run_matrix
from repro.run.memory import GIB, KEEP_FREE, MemoryBudget, case_bytes


def test_a_budget_holds_what_fits_and_a_case_larger_than_it_runs_alone():
    b = MemoryBudget(10 * GIB)
    with b.hold(4 * GIB), b.hold(6 * GIB):
        assert b.held == 10 * GIB
    got = []

    def big():
        with b.hold(50 * GIB):  # more than the whole budget: waits for all of it
            got.append(b.held)

    with b.hold(1 * GIB):
        t = threading.Thread(target=big)
        t.start()
        time.sleep(0.05)
        assert not got  # still waiting: 1 GiB is held
    t.join(2)
    assert got == [10 * GIB] and b.held == 0


def test_the_budget_is_the_emptiest_gpus_free_memory_less_a_margin():
    b = MemoryBudget.of_free_gpu([(139.8, 139.0), (139.8, 100.0)])
    assert b.total == int(100.0 * (1 - KEEP_FREE) * GIB)
    assert MemoryBudget.of_free_gpu([]) is None  # no GPU known: no limit


def test_128k_cases_run_as_many_at_a_time_as_the_h200s_free_memory_holds(monkeypatch, tmp_path):
    """16 cases of max_model_len 131072 (32 GiB of K and V each) at 6 jobs on an H200 with 139 GiB free: 3 at a time."""
    cfg = AttnConfig(max_model_len=131072)
    specs = [s for s in build_specs(MatrixOptions(cfg=cfg)) if s.sm.kind != "mps"][:16]
    need = case_bytes(cfg.device_bytes())
    assert need > 32 * GIB
    lock, now, worst = threading.Lock(), [0], [0]

    def stand_in(spec, log_dir, daemon=None, executor=None):
        with lock:
            now[0] += 1
            worst[0] = max(worst[0], now[0])
        time.sleep(0.02)
        with lock:
            now[0] -= 1
        return CaseResult(spec.case_id, CLEAN, "stand-in")

    monkeypatch.setattr(runner, "run_case", stand_in)
    budget = MemoryBudget.of_free_gpu([(139.8, 139.0)])
    run = run_matrix(specs, tmp_path, jobs=6, memory=budget)
    assert len(run.results) == len(specs)
    assert worst[0] == budget.total // need == 3 and budget.held == 0
    # the default shape's cases are small: the jobs bound them, not the memory
    now[0] = worst[0] = 0
    small = [s for s in build_specs(MatrixOptions()) if s.sm.kind != "mps"][:12]
    run = run_matrix(small, tmp_path, jobs=6, memory=MemoryBudget.of_free_gpu([(139.8, 139.0)]))
    assert worst[0] == 6
