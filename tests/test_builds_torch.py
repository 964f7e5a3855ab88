"""A torch of its own per build (gate --torch LABEL=PREFIX): a release that pins another torch runs with that torch
first on its cases' PYTHONPATH, never with another build's; the reference cache keys on that torch's release; bad
input is refused in one line."""

from __future__ import annotations

import os

import pytest

from repro.errors import ConfigError
from repro.vllm_integration.gate.cache import GateCache
from repro.vllm_integration.releases.builds import (
    CONTROL,
    UNDER_TEST,
    attach_torch,
    build_pythonpath,
    make_overlays,
    parse_builds,
    parse_overlays,
)


def _prefix(tmp_path, name, version="0.33.0"):
    d = tmp_path / name
    (d / "vllm").mkdir(parents=True)
    (d / "vllm" / "__init__.py").write_text("")
    (d / "vllm" / "_version.py").write_text(f"__version__ = '{version}'\n")
    return d


def _torch(tmp_path, name, version):
    d = tmp_path / name
    (d / "torch").mkdir(parents=True)
    (d / "torch" / "__init__.py").write_text("")
    (d / f"torch-{version}.dist-info").mkdir()
    (d / f"torch-{version}.dist-info" / "METADATA").write_text(f"Name: torch\nVersion: {version}\n")
    return d


def test_each_build_runs_with_its_own_torch_and_never_another_builds(tmp_path):
    new, old = _prefix(tmp_path, "v0330"), _prefix(tmp_path, "v0251", "0.25.1")
    builds = parse_builds(f"0.33.0={new}", UNDER_TEST, "--vllm") + parse_builds(f"0.25.1={old}", CONTROL, "--control")
    t214 = _torch(tmp_path, "torch214", "2.14.0+cu130")
    builds = attach_torch(builds, f"0.33.0={t214}")
    b033, b025 = builds
    assert b033.torch_prefix == str(t214.resolve()) and b033.torch_version == "2.14.0+cu130"
    assert b025.torch_prefix is None and b025.torch_version is None
    current = os.pathsep.join(["/site/extra", str(t214.resolve()), str(old.resolve())])
    assert build_pythonpath(b033, builds, current).split(os.pathsep) == [
        str(t214.resolve()),
        str(new.resolve()),
        "/site/extra",
    ]
    assert build_pythonpath(b025, builds, current).split(os.pathsep) == [str(old.resolve()), "/site/extra"]
    assert b033.to_dict()["torch_prefix"] == str(t214.resolve()) and "torch_prefix" not in b025.to_dict()


def test_the_reference_cache_keys_on_the_builds_own_torch(tmp_path):
    new = _prefix(tmp_path, "v0330")
    (build,) = parse_builds(f"0.33.0={new}", UNDER_TEST, "--vllm")
    with_214 = attach_torch([build], f"0.33.0={_torch(tmp_path, 't214', '2.14.0')}")[0]
    with_213 = attach_torch([build], f"0.33.0={_torch(tmp_path, 't213', '2.13.0')}")[0]
    cache = GateCache(tmp_path / "cache")
    assert len({cache.fingerprint(build), cache.fingerprint(with_214), cache.fingerprint(with_213)}) == 3


@pytest.mark.parametrize(
    "text, words",
    [
        ("0.33.0", "is not LABEL=PREFIX"),
        ("0.99.0={t}", "no build is labelled '0.99.0'"),
        ("0.33.0={t},0.33.0={t}", "given a torch twice"),
        ("0.33.0={empty}", "holds no torch package"),
    ],
)
def test_bad_torch_options_are_refused_in_one_line(tmp_path, text, words):
    (build,) = parse_builds(f"0.33.0={_prefix(tmp_path, 'v')}", UNDER_TEST, "--vllm")
    t, empty = _torch(tmp_path, "t", "2.14.0"), tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=words):
        attach_torch([build], text.format(t=t, empty=empty))


def test_an_overlay_runs_with_its_base_builds_torch_or_the_one_named_for_it(tmp_path):
    """An overlay's compiled parts are its base's, linked against the base's torch: it inherits that torch unless
    --torch names one for its label; an overlay over a base without one runs with the installed torch."""
    new, old = _prefix(tmp_path, "v0330"), _prefix(tmp_path, "v0251", "0.25.1")
    for base in (new, old):
        (base / "vllm" / "_C.abi3.so").write_text("binary")
    t214, t213 = _torch(tmp_path, "t214", "2.14.0"), _torch(tmp_path, "t213", "2.13.0")
    builds = attach_torch(
        parse_builds(f"0.33.0={new}", UNDER_TEST, "--vllm") + parse_builds(f"0.25.1={old}", CONTROL, "--control"),
        f"0.33.0={t214}",
    )
    src = _prefix(tmp_path, "mutant-src")
    overlays = parse_overlays([f"mutant={src}@{new}", f"named={src}@{new}", f"old={src}@{old}"])
    made = make_overlays(overlays, tmp_path / "made", builds, {"mutant": None, "named": str(t213), "old": None})
    assert [(b.label, b.torch_prefix) for b in made] == [
        ("mutant", str(t214.resolve())),
        ("named", str(t213)),
        ("old", None),
    ]
    assert build_pythonpath(made[0], builds + made, "").split(os.pathsep)[0] == str(t214.resolve())
