"""A build's classes read from its files (releases.source_classes): a base class outside vLLM (abc.ABC, torch's
nn.Module) or a relative import never raises, and ends or continues the search as Python would resolve it. vLLM
0.33.0's EagleSpeculator descends from classes whose last base is `ABC`: the dynamic-K applicability check walked up
to it and raised ValueError (`PosixPath('.') has an empty name`) where it should say the method is not applicable."""

from __future__ import annotations

import ast
from pathlib import Path

from repro.vllm_integration.gate import dynamic_k, methods
from repro.vllm_integration.releases import source_classes as sc

SPEC = Path("v1") / "worker" / "gpu" / "spec_decode"


def _write(root: Path, files: dict[Path, str]) -> Path:
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _speculators(root: Path, ar_base: bool) -> Path:
    """An EAGLE speculator as 0.33.0 shapes it (its base through a relative import, then `ABC`), or as 0.34.0 does
    (the autoregressive base in between, imported relatively from a package's __init__)."""
    base = "AutoRegressiveSpeculator" if ar_base else "BaseSpeculator"
    return _write(
        root,
        {
            SPEC / "speculator_config.py": 'TABLE = {"eagle": ("eagle.config", "EagleSpeculatorConfig")}\n',
            SPEC / "eagle" / "config.py": "class EagleSpeculatorConfig:\n"
            '    speculator_class = "vllm.v1.worker.gpu.spec_decode.eagle.speculator.EagleSpeculator"\n',
            SPEC / "eagle" / "speculator.py": f"from ..autoregressive import {base}\n"
            f"class EagleSpeculator({base}):\n    pass\n",
            SPEC / "autoregressive" / "__init__.py": "from .speculator import AutoRegressiveSpeculator\n"
            "from ..base import BaseSpeculator\n",
            SPEC / "autoregressive" / "speculator.py": "from ..base import BaseSpeculator\n"
            "class AutoRegressiveSpeculator(BaseSpeculator):\n    pass\n",
            SPEC / "base.py": "from abc import ABC\nimport torch.nn as nn\n"
            "class BaseSpeculator(ABC, nn.Module):\n    def capture(self):\n        self.graph()\n",
            SPEC / "autoregressive" / "cudagraph_utils.py": "def specialize_spec_tokens(): ...\n",
            Path("config") / "speculative.py": "num_speculative_tokens_per_batch_size = None\n",
        },
    )


def test_a_base_outside_vllm_ends_the_search_without_an_error(tmp_path):
    root = _speculators(tmp_path / "v033", ar_base=False)
    module = "vllm.v1.worker.gpu.spec_decode.eagle.speculator"
    names: list[str] = []
    assert sc.lookup(root, module, "EagleSpeculator", lambda c: names.append(c.name)) is None
    assert names == ["EagleSpeculator", "BaseSpeculator"]  # through the relative imports; ABC and nn.Module: not vLLM
    assert sc.module_file(root, "abc") is None and sc.module_file(root, "torch.nn") is None
    assert sc.find_class(root, "abc", "ABC") is None
    # the method is found and captures; its dynamic-K form is not applicable, with the reason, instead of raising
    assert methods.not_applicable(root, "eagle") is None
    why = methods.not_applicable(root, dynamic_k.name_of("eagle"))
    assert why and "not an autoregressive speculator" in why


def test_a_relative_import_resolves_against_the_importing_module(tmp_path):
    root = _speculators(tmp_path / "v034", ar_base=True)
    module = "vllm.v1.worker.gpu.spec_decode.eagle.speculator"
    found = sc.lookup(root, module, "EagleSpeculator", lambda c: c.name == dynamic_k.AR_BASE or None)
    assert found is True  # EagleSpeculator -> (..autoregressive's __init__ re-export) AutoRegressiveSpeculator
    assert methods.not_applicable(root, dynamic_k.name_of("eagle")) is None
    tree = ast.parse("from . import x\nfrom .a import b\nfrom ..c import d\nfrom .... import e\n")
    got = sc.imports(tree, "vllm.v1.pkg.mod")
    want = {"x": ("vllm.v1.pkg", "x"), "b": ("vllm.v1.pkg.a", "b"), "d": ("vllm.v1.c", "d")}
    assert got == want  # past the top: left out
    assert sc.imports(tree, "vllm.v1.pkg", is_package=True)["b"] == ("vllm.v1.pkg.a", "b")  # a package's __init__


def test_a_missing_or_broken_file_is_no_answer(tmp_path):
    root = _write(tmp_path / "v", {Path("a.py"): "def (:\n"})
    assert sc.parse(None) is None and sc.parse(root / "a.py") is None and sc.parse(root / "missing.py") is None
    assert sc.find_class(root, "vllm.a", "X") is None and sc.module_file(root, "vllm") == root / "__init__.py"


def test_a_class_is_found_through_an_alias_a_module_attribute_and_a_subscript(tmp_path):
    root = _write(
        tmp_path / "v",
        {
            Path("a") / "__init__.py": "from .impl import Real as Alias\nfrom . import basemod\n",
            Path("a") / "impl.py": "class Real:\n    pass\n",
            Path("a") / "basemod.py": "class Base:\n    marker = 'here'\n",
            Path("a") / "gen.py": "class Gen:\n    marker = 'generic'\n",
            Path("b.py"): "import vllm.a.gen as g\nfrom vllm.a import basemod, Alias\nimport vllm.a.basemod\n"
            "class ByModule(basemod.Base):\n    pass\n"
            "class ByGeneric(g.Gen[int]):\n    pass\n"
            "class ByDotted(vllm.a.basemod.Base):\n    pass\n"
            "class ByAlias(Alias):\n    pass\n",
        },
    )
    found = sc.find_class(root, "vllm.a", "Alias")  # re-exported under another name: the class is Real
    assert found is not None and found[0].name == "Real" and found[2] == "vllm.a.impl"
    marker = lambda c: sc.assigned(c, "marker")  # noqa: E731
    assert sc.lookup(root, "vllm.b", "ByModule", marker) == "here"
    assert sc.lookup(root, "vllm.b", "ByGeneric", marker) == "generic"
    assert sc.lookup(root, "vllm.b", "ByDotted", marker) == "here"
    assert sc.lookup(root, "vllm.b", "ByAlias", lambda c: c.name if c.name == "Real" else None) == "Real"


def test_init_speculators_relative_import_names_the_speculator(tmp_path):
    """0.24-0.26 dispatch in init_speculator: a branch importing its speculator relatively still names it."""
    root = _write(
        tmp_path / "v",
        {
            SPEC / "__init__.py": "def init_speculator(cfg):\n    if cfg.method == 'eagle':\n"
            "        from .eagle import EagleSpeculator\n        return EagleSpeculator()\n",
            SPEC / "eagle.py": "class EagleSpeculator:\n    def capture(self):\n        self.graph()\n",
        },
    )
    assert methods.speculator_class(root, "eagle") == "EagleSpeculator"
    assert methods.not_applicable(root, "eagle") is None
