"""The gate's placement over devices (repro.vllm_integration.gate.placement, gate --devices) with stand-in devices: which
devices a spec names, that no device holds more cases at once than its share, that a case and its reference run on
devices of the same kind, that every case's record names its device, and that the one-device path is unchanged."""

from __future__ import annotations

import threading
import time

import pytest

from repro.case.spec import CaseResult
from repro.contract.verdicts import CLEAN
from repro.errors import ConfigError, Unavailable
from repro.run.smcontrol import GpuInfo, MigSlice
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.gate.placement import DevicePool, GateDevice, gate_devices, kind_of, per_device_jobs
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild


def two_gpus():
    return [GpuInfo(i, "NVIDIA H200", f"GPU-{i}", 132, False) for i in range(2)]


def mig_runner():
    small = [MigSlice(0, j, f"MIG-a{j}", "1g.18gb", 16, 16000) for j in range(3)]
    big = [MigSlice(0, 3, "MIG-b", "3g.71gb", 60, 71000)]
    return [GpuInfo(0, "NVIDIA H200", "GPU-0", 132, True, tuple(small + big))]


def test_devices_all_finds_every_gpu_and_on_a_mig_runner_the_smallest_slices():
    assert [d.dev for d in gate_devices("all", two_gpus)] == ["GPU-0", "GPU-1"]
    assert [(d.dev, d.sms) for d in gate_devices("all", mig_runner)] == [("MIG-a0", 16), ("MIG-a1", 16), ("MIG-a2", 16)]
    assert gate_devices(None, two_gpus) == [] and gate_devices("none", two_gpus) == []  # the one-device path


def test_named_devices_are_looked_up_and_bad_lists_refused():
    assert [(d.dev, d.kind, d.sms) for d in gate_devices("1,GPU-0", two_gpus)] == [
        ("1", "gpu", 132),
        ("GPU-0", "gpu", 132),
    ]

    def no_nvml():
        raise Unavailable("NVML unavailable")

    assert [(d.dev, d.kind) for d in gate_devices("0,1", no_nvml)] == [("0", "given"), ("1", "given")]
    for bad, words in (("0,0", "named twice"), (",", "no device named")):
        with pytest.raises(ConfigError, match=words):
            gate_devices(bad, two_gpus)
    with pytest.raises(Unavailable, match="no device found"):  # could not run here (exit 4), not bad input
        gate_devices("all", no_nvml)


def test_jobs_are_divided_over_the_devices_and_a_mig_slice_takes_one_case():
    gpus = gate_devices("all", two_gpus)
    assert per_device_jobs(8, gpus) == 4 and per_device_jobs(1, gpus) == 1
    assert per_device_jobs(8, gate_devices("all", mig_runner)) == 1
    assert per_device_jobs(8, gpus[:1]) == 8  # one device: --jobs as before


def test_the_pool_never_puts_more_cases_on_a_device_than_its_share():
    pool = DevicePool([GateDevice("0", "gpu", 132), GateDevice("1", "gpu", 132)], per_device=2)
    held, worst, lock = {"0": 0, "1": 0}, {"0": 0, "1": 0}, threading.Lock()

    def case():
        d = pool.take()
        with lock:
            held[d.dev] += 1
            worst[d.dev] = max(worst[d.dev], held[d.dev])
        time.sleep(0.01)
        with lock:
            held[d.dev] -= 1
        pool.give(d)

    threads = [threading.Thread(target=case) for _ in range(24)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert worst == {"0": 2, "1": 2} and pool.busy == {"0": 0, "1": 0}
    with pytest.raises(ConfigError, match="no device of kind"):
        pool.take(("mig", 16))


def test_run_gate_places_every_case_and_its_reference_on_one_kind_of_device(monkeypatch, tmp_path):
    seen, lock, at_once, worst = [], threading.Lock(), {}, {}

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        with lock:
            seen.append((case, device))
            at_once[device.dev] = at_once.get(device.dev, 0) + 1
            worst[device.dev] = max(worst.get(device.dev, 0), at_once[device.dev])
        time.sleep(0.02)
        with lock:
            at_once[device.dev] -= 1
        return CaseResult(case.case_id, CLEAN, "", backend_identity={"device": device.to_dict()}), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    devices = [GateDevice("GPU-0", "gpu", 132), GateDevice("GPU-1", "gpu", 132), GateDevice("GPU-2", "gpu", 114)]
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    run = gate_run.run_gate([build], parse_modes("audit,plain,sm_margin:16"), tmp_path / "logs", jobs=2,
                            self_control="none", devices=devices)  # fmt: skip
    assert len(seen) == 3 + 2  # three cases, two references (full GPU, sm_margin:16)
    # the two H200s of 132 SMs take everything: never the third kind, one case per device at a time (2 jobs / 3)
    assert {d.dev for _, d in seen} == {"GPU-0", "GPU-1"} and max(worst.values()) == 1
    assert all(kind_of(d) == ("gpu", 132) for _, d in seen)
    assert all((r.backend_identity or {}).get("device", {}).get("dev") in ("GPU-0", "GPU-1") for _, r in run.cases)


def test_the_default_concurrency_is_fitted_to_the_cores_and_the_gpu_memory():
    from repro.vllm_integration.gate.placement import fit_jobs

    assert fit_jobs(16, [(139.8, 139.0)])[0] == 16  # the H200 machine: one a core (its memory holds 31)
    jobs, why = fit_jobs(16, [(80.0, 79.0)])  # the H100 machine: one a core (its memory holds 17)
    assert jobs == 16 and "at most 8 at once on a build's cold caches" in why  # placement.ColdSlots: half the cores
    assert fit_jobs(16, [(139.8, 20.0)])[0] == 1  # a GPU another job fills: (20 - 14) // 4
    assert fit_jobs(16, [(80.0, 79.0), (80.0, 40.0)], devices=2)[0] == 16  # the emptiest of two GPUs, times two
    assert fit_jobs(16, [(80.0, 30.0)])[0] == 5  # the GPU's memory bounds it: (30 - 8) // 4
    jobs, why = fit_jobs(2, [])
    assert jobs == 1 and "no GPU memory known" in why


def test_a_fitted_gate_counts_processes_a_plain_cases_rerun_beside_it_too():
    """A plain case's launch-blocking rerun beside it is a second process: it holds two of the fitted process slots
    and two cold-cache slots, so the cases at once never exceed the cores; a case alone always runs."""
    import types

    from repro.vllm_integration.gate.placement import ColdSlots, ProcessSlots

    slots = ProcessSlots(3)
    got = threading.Event()

    def second():
        with slots.hold(2):
            got.set()

    with slots.hold(2):
        threading.Thread(target=second, daemon=True).start()
        assert not got.wait(0.2)  # 2 + 2 > 3: waits
    assert got.wait(2.0) and slots.worst == 2
    with ProcessSlots(1).hold(2):  # more than the limit: runs alone
        pass
    with ProcessSlots(None).hold(5):  # an explicit --jobs: cases counted, as before
        pass
    cold = ColdSlots(3, warm=lambda c: False, poll_s=0.01)
    case = types.SimpleNamespace(reference=False)
    with cold.hold(case, 2):
        assert cold.running == 2
    assert cold.running == 0


def test_the_gates_memory_budget_leaves_what_each_case_must_find_free_at_its_start():
    from repro.run.memory import GIB, MemoryBudget

    b = MemoryBudget.of_free_gpu([(80.0, 79.0)], keep_of_total=0.1)  # vLLM's check: 8 GiB free at each start
    assert b.total == int((79.0 - 8.0) * GIB)
    assert MemoryBudget.of_free_gpu([(80.0, 79.0)]).total == int(79.0 * 0.9 * GIB)  # the matrix's, unchanged
