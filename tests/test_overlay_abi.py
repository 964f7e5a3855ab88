"""An overlay (one release's Python sources over another build's compiled parts) is refused when the two sides were
built for different torch releases; the pins are read where vLLM writes them."""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from repro.errors import AbiMismatch
from repro.exit_codes import Exit
from repro.vllm_integration.releases import versions
from repro.vllm_integration.releases.bisect import (
    abi_problem,
    build_overlay,
    step,
    torch_pin,
)
from tests.commands import ROOT, isolated_env


def _checkout(root: Path, torch: str | None, layout: str = "requirements/cuda.txt") -> Path:
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("__version__ = 'x'\n")
    if torch:
        (root / layout).parent.mkdir(parents=True, exist_ok=True)
        (root / layout).write_text(f"-r common.txt\nnumba == 0.61.2\ntorch=={torch}\ntorchaudio=={torch}\n")
    return root


def _installed(site: Path, torch: str | None) -> Path:
    pkg = site / "vllm"
    (pkg / "vllm_flash_attn").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "_C.abi3.so").write_bytes(b"\x7fELF")
    if torch:
        info = site / "vllm-0.26.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.4\nName: vllm\nVersion: 0.26.0\nRequires-Dist: torch=={torch}\n"
        )
    return pkg


def test_pins_are_read_from_a_checkout_and_an_installed_package(tmp_path):
    assert torch_pin(_checkout(tmp_path / "co", "2.13.0"))[0] == "2.13.0"
    assert torch_pin(_checkout(tmp_path / "old", "2.5.1", "requirements-cuda.txt"))[0] == "2.5.1"
    assert torch_pin(_installed(tmp_path / "site", "2.11.0")) == ("2.11.0", "vllm-0.26.0.dist-info/METADATA")
    assert torch_pin(tmp_path / "nothing")[0] is None


def test_an_overlay_across_torch_releases_is_refused(tmp_path):
    co = _checkout(tmp_path / "co", "2.13.0")
    inst = _installed(tmp_path / "site", "2.11.0")
    why = abi_problem(co, inst)
    assert why and "torch 2.13.0" in why and "torch 2.11.0" in why
    with pytest.raises(AbiMismatch, match="ABI mismatch"):
        build_overlay(co, inst, tmp_path / "ov")
    assert not (tmp_path / "ov" / "vllm").exists()


def test_same_torch_or_an_unknown_pin_is_overlaid(tmp_path):
    inst = _installed(tmp_path / "site", "2.11.0")
    assert build_overlay(_checkout(tmp_path / "co", "2.11.0"), inst, tmp_path / "ov").is_dir()
    assert abi_problem(_checkout(tmp_path / "nopin", None), inst) is None


def test_a_bisect_step_on_a_mismatched_commit_is_untestable(tmp_path, capsys, monkeypatch):
    co = _checkout(tmp_path / "co", "2.14.0")
    inst = _installed(tmp_path / "site", "2.11.0")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    assert step(str(co), "gate", ["true"], str(inst)) == Exit.UNTESTABLE == 125
    assert "ABI mismatch" in capsys.readouterr().out
    assert list((tmp_path / "tmp").iterdir()) == []  # the overlay folder it made is gone


H200_RELEASES = ("0.23.0", "0.24.0", "0.25.1", "0.26.0")  # run on the H200 with its torch 2.11.0 (results/h200-vllm*)
RECORDED_PINS = {r["version"]: r["torch_pin"] for r in versions.load()}  # results/vllm-versions.json


def test_the_releases_run_on_the_h200_pin_its_torch():
    """0.23.0, 0.24.0 (an overlay on 0.25.1), 0.25.1 and 0.26.0 pin torch 2.11.0, the H200's: their overlays are
    allowed; 0.27 and later pin 2.13 or newer (read, not run there)."""
    assert {RECORDED_PINS[v] for v in H200_RELEASES} == {"2.11.0"}, RECORDED_PINS
    later = {v: pin for v, pin in RECORDED_PINS.items() if versions.version_key(v) >= (0, 27)}
    assert later and all(versions.version_key(pin) >= (2, 13) for pin in later.values()), later


@pytest.mark.skipif(not os.environ.get("REPRO_VLLM_WHEELS"), reason="REPRO_VLLM_WHEELS names no folder of vLLM wheels")
def test_release_wheels_pin_the_torch_recorded_for_them():
    """Each real wheel pins the torch its row records (0.33.0 pins 2.14.0, not the H200's 2.11.0)."""
    pins = {}
    for whl in sorted(Path(os.environ["REPRO_VLLM_WHEELS"]).glob("vllm-*.whl")):
        if (version := versions.wheel_version(whl)) in RECORDED_PINS:
            pins[version] = versions.torch_pin_of(whl)
    assert pins and pins == {v: RECORDED_PINS[v] for v in pins}, pins


def test_a_checkout_named_vllm_is_read_as_a_checkout(tmp_path):
    """`git clone .../vllm` gives a checkout named vllm: its own requirements pin it (it is no package folder)."""
    co = _checkout(tmp_path / "vllm", "2.13.0")
    assert torch_pin(co)[0] == "2.13.0"
    assert abi_problem(co, _installed(tmp_path / "site", "2.11.0"))


def test_a_step_that_breaks_is_untestable_not_bad(tmp_path, monkeypatch, capsys):
    from repro.vllm_integration.releases import bisect

    def broken(*a, **k):
        raise PermissionError("overlay folder not writable")

    monkeypatch.setattr(bisect, "step", broken)
    assert bisect.main(["step", "--repo", str(tmp_path), "--check", "gate", "--", "true"]) == Exit.UNTESTABLE == 125
    assert "untestable: PermissionError" in capsys.readouterr().out


def test_an_overlay_whose_sources_need_an_extension_the_build_lacks_is_refused(tmp_path):
    """0.23.0's platforms/cuda.py imports vllm._C at module level; 0.24 and later ship _C_stable_libtorch only: 0.23.0's
    sources over 0.25.1's compiled parts are refused, 0.24.0's and 0.25.0's allowed (the same torch, the same
    extension modules)."""
    co = _checkout(tmp_path / "co", "2.11.0")
    (co / "vllm" / "platforms").mkdir()
    (co / "vllm" / "platforms" / "cuda.py").write_text(
        "import torch\nimport vllm._C  # noqa\nimport vllm.envs\ntry:\n    import vllm._flashmla_C\nexcept ImportError:\n"
        "    pass\n\ndef f():\n    import vllm._moe_C\n"
    )
    (co / "vllm" / "envs.py").write_text("")
    inst = _installed(tmp_path / "site", "2.11.0")
    (inst / "_C.abi3.so").rename(inst / "_C_stable_libtorch.abi3.so")
    why = abi_problem(co, inst)
    assert why and "vllm._C (imported by vllm/platforms/cuda.py)" in why
    assert "_flashmla" not in why and "_moe_C" not in why  # under a try, inside a function: optional
    (inst / "_C.abi3.so").write_bytes(b"\x7fELF")
    assert abi_problem(co, inst) is None


def test_an_overlay_build_takes_the_sources_version_and_the_base_dependencies(tmp_path):
    from repro.vllm_integration.releases.builds import overlay_build
    from tests.fake_vllm import write_fake_vllm

    base = write_fake_vllm(tmp_path / "base", "0.25.1", "good")
    (base / "vllm" / "_C_stable_libtorch.abi3.so").write_bytes(b"\x7fELF")
    (base / "somedep").mkdir()
    src = tmp_path / "src"
    shutil.copytree(base / "vllm", src / "vllm", ignore=shutil.ignore_patterns("*.so"))
    (src / "vllm" / "_version.py").write_text('__version__ = "0.24.0"\n')
    b = overlay_build("0.24.0", src, base, tmp_path / "ov")
    assert b.version == "0.24.0" and b.label == "0.24.0" and b.role == "under-test"
    dest = Path(b.prefix)
    assert (dest / "somedep").is_symlink() and (dest / "vllm" / "_C_stable_libtorch.abi3.so").is_symlink()
    assert not (dest / "vllm").is_symlink()  # the sources, copied
    # sources without a dist-info (a wheel's vllm/ alone, a checkout): the build gets one, with the sources' version,
    # which is what vLLM's platform check asks importlib.metadata for
    (info,) = dest.glob("vllm-*.dist-info")
    assert info.name == "vllm-0.24.0.dist-info"
    found = importlib.metadata.distributions(path=[str(dest)])
    assert [(d.metadata["Name"], d.version) for d in found] == [("vllm", "0.24.0")]


def _wheel(folder: Path, version: str, torch: str) -> None:
    with zipfile.ZipFile(folder / f"vllm-{version}-cp38-abi3-manylinux_2_28_x86_64.whl", "w") as z:
        z.writestr(
            f"vllm-{version}.dist-info/METADATA", f"Name: vllm\nVersion: {version}\nRequires-Dist: torch=={torch}\n"
        )


@pytest.mark.parametrize("pin_033, code", [("2.14.0", 0), ("2.11.0", 1)])
def test_wheel_pins_are_each_held_to_their_record(tmp_path, pin_033, code):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "0.26.0", "2.11.0")
    _wheel(wheels, "0.33.0", pin_033)  # the record says 2.14.0
    test = "tests/test_overlay_abi.py::test_release_wheels_pin_the_torch_recorded_for_them"
    full = {k: v for k, v in isolated_env(tmp_path).items() if not k.startswith("PYTEST_XDIST")}
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**full, "REPRO_VLLM_WHEELS": str(wheels)},
    )
    assert r.returncode == code and ("1 passed" if code == 0 else "1 failed") in r.stdout, r.stdout[-2000:]
