"""MIG enumeration through a stand-in NVML, MPS percentages, and xdist pinning."""

import tempfile
from types import SimpleNamespace

import pytest

from repro.run.pinning import PINNED_VAR, apply_pin, choose_pin, worker_index
from repro.run.smcontrol import (
    GpuInfo,
    MigSlice,
    Unavailable,
    enumerate_gpus,
    mps_granted_sms,
    mps_percentage,
)


class FakeNvml:
    """Two H200s: GPU 0 split into 1g.18gb slices (16 SMs each), GPU 1 without MIG."""

    def __init__(self, fail=False):
        self.fail, self.shut = fail, False

    def nvmlInit(self):
        if self.fail:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlShutdown(self):
        self.shut = True

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return ("gpu", i)

    def nvmlDeviceGetMigMode(self, h):
        return (1, 1) if h[1] == 0 else (0, 0)

    def nvmlDeviceGetMaxMigDeviceCount(self, h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, j):
        if j >= 3:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return ("mig", h[1], j)

    def nvmlDeviceGetAttributes(self, m):
        return SimpleNamespace(multiprocessorCount=16)

    def nvmlDeviceGetMemoryInfo(self, m):
        return SimpleNamespace(total=18 * 1024**3)

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H200 MIG 1g.18gb" if h[0] == "mig" else b"NVIDIA H200"

    def nvmlDeviceGetUUID(self, h):
        return f"MIG-{h[1]}-{h[2]}" if h[0] == "mig" else f"GPU-{h[1]}"


def test_enumerate_mig_slices():
    nv = FakeNvml()
    gpus = enumerate_gpus(nv)
    assert [g.mig_mode for g in gpus] == [True, False]
    assert [s.uuid for s in gpus[0].slices] == ["MIG-0-0", "MIG-0-1", "MIG-0-2"]
    assert {(s.profile, s.sms, s.memory_mib) for s in gpus[0].slices} == {("1g.18gb", 16, 18432)}
    assert nv.shut


def test_nvml_missing_is_unavailable():
    with pytest.raises(Unavailable, match="NVML unavailable"):
        enumerate_gpus(FakeNvml(fail=True))


@pytest.mark.parametrize("pct, sms", [(12, 14), (13, 16), (25, 32), (50, 66)])
def test_mps_grant_matches_h200_measurements(pct, sms):
    assert mps_granted_sms(pct, 132) == sms


def test_mps_percentage_for_requested_sms():
    assert mps_percentage(16, 132) == 13
    assert mps_percentage(32, 132) == 25
    assert mps_granted_sms(mps_percentage(26, 132), 132) >= 26
    with pytest.raises(Unavailable):
        mps_percentage(200, 132)


def _gpus():
    return enumerate_gpus(FakeNvml())


def test_xdist_workers_pin_to_mig_slices_round_robin():
    env = {}
    pins = [choose_pin(f"gw{i}", env, _gpus) for i in range(4)]
    assert [p.device for p in pins] == ["MIG-0-0", "MIG-0-1", "MIG-0-2", "MIG-0-0"]
    assert pins[0].kind == "mig" and pins[0].sms == 16


def test_pinning_without_mig_uses_whole_gpus():
    gpus = [GpuInfo(0, "H200", "GPU-a", 132, False), GpuInfo(1, "H200", "GPU-b", 132, False)]
    assert choose_pin("gw1", {}, lambda: gpus).device == "GPU-b"


def test_pinning_respects_user_and_override_and_main_process():
    assert worker_index("master") is None and choose_pin("", {}, _gpus) is None
    assert choose_pin("gw0", {"CUDA_VISIBLE_DEVICES": "3"}, _gpus) is None
    assert choose_pin("gw1", {"REPRO_DEVICES": "MIG-x, MIG-y"}, _gpus).device == "MIG-y"

    def nothing():
        raise Unavailable("no NVML")

    assert choose_pin("gw0", {}, nothing) is None
    env = {}
    apply_pin(choose_pin("gw2", {}, _gpus), env)
    assert env == {"CUDA_VISIBLE_DEVICES": "MIG-0-2", PINNED_VAR: "MIG-0-2"}


def test_mig_slice_record():
    s = MigSlice(0, 1, "MIG-u", "1g.35gb", 26, 35000)
    assert s.to_dict()["sms"] == 26


def test_probe_clients_report_their_last_line_or_exit_status():
    import os

    from repro.run.smcontrol import _run_clients

    env = dict(os.environ)
    seen = _run_clients([("a", "print('warming'); print('ok 16')", env), ("b", "import sys; sys.exit(3)", env)], 0, 0)
    assert seen == {"a": "ok 16", "b": "exit 3"}


def test_mps_daemon_writes_nothing_until_started_and_removes_its_folder(tmp_path, monkeypatch):
    from repro.errors import Unavailable
    from repro.run.smcontrol import MpsDaemon

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))  # no nvidia-cuda-mps-control
    d = MpsDaemon()
    assert not any(tmp_path.iterdir()) and d.env == {}
    with pytest.raises(Unavailable):
        d.start()
    d.stop()
    assert not any(tmp_path.iterdir())
    (tmp_path / "bin").mkdir()
    fail = tmp_path / "bin" / "nvidia-cuda-mps-control"
    fail.write_text("#!/bin/sh\necho 'cannot start' >&2\nexit 1\n")
    fail.chmod(0o755)
    with pytest.raises(Unavailable, match="did not start: cannot start"), MpsDaemon():
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]  # the failed start removed its folder


def test_an_sm_count_the_gpu_cannot_give_is_refused_with_the_nearest_ones():
    """MPS's active-thread percentages give a 132-SM H200 even SM counts only (measured: 12% -> 14, 13% -> 16): a case
    asking 23 would run on 24 and fail its SM check after its whole run; it is refused before, naming mps:22 / mps:24."""
    from repro.run.smcontrol import sm_refusal

    assert sm_refusal("mps", 24, 132) is None and sm_refusal("sm_margin", 23, 132) is None
    assert sm_refusal("mps", 23, 132) == (
        "mps:23: MPS gives this 132-SM GPU no 23 SMs (the nearest percentage gives 24): use mps:22 or mps:24"
    )
    assert sm_refusal("mps", 8, 16) is None  # a 16-SM MIG slice: 50% gives 8
    assert "impossible SM count, this GPU has 132" in sm_refusal("sm_margin", 200, 132)
    assert sm_refusal("full", None, 132) is None


def test_the_gate_refuses_an_mps_count_the_gpu_cannot_give_before_any_case_runs(monkeypatch, tmp_path):
    from repro.errors import ConfigError
    from repro.vllm_integration.gate import run as gate_run
    from repro.vllm_integration.gate.modes import parse_modes
    from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild

    monkeypatch.setattr(gate_run, "device_sm_count", lambda: 132)
    monkeypatch.setattr(gate_run, "run_control", lambda *a, **k: pytest.fail("a case ran"))
    build = VllmBuild("0.26.0", str(tmp_path), UNDER_TEST, "0.26.0")
    with pytest.raises(ConfigError, match=r"gate mode audit\+mps:23: mps:23: .* use mps:22 or mps:24"):
        gate_run.run_gate([build], parse_modes("audit,audit+mps:23"), tmp_path / "logs")
