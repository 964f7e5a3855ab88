"""scripts/relayout.py's rewriting rules, on text made here (this file is one the script never rewrites): names and
paths of moved modules before the move and after it, `from PACKAGE import module` statements, the modules that keep
their names, the packages that carry an old module's name, and that a second pass changes nothing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("relayout", ROOT / "scripts" / "relayout.py")
relayout = sys.modules.setdefault("relayout", importlib.util.module_from_spec(_spec))  # dataclasses look it up
_spec.loader.exec_module(relayout)


def rewriter(before_the_move: bool):
    """The rewriter of LAYOUT: before the move every old module is still in place; after it none is."""
    plan = relayout.check_table()
    if before_the_move:
        plan.present = set(plan.moved)
    return relayout.Rewriter(plan, ROOT)


BEFORE = [
    ("from repro.policy import decide\n", "from repro.judge.policy import decide\n"),
    ("python -m repro.smcontrol --probe-coexistence", "python -m repro.run.smcontrol --probe-coexistence"),
    ('cmd = [sys.executable, "-m", "repro.worker"]', 'cmd = [sys.executable, "-m", "repro.attention.worker"]'),
    ('"repro.worker:main"', '"repro.attention.worker:main"'),
    ("(repro.case.revise)", "(repro.case.spec.revise)"),
    ("from repro.report import header\n", "from repro.report.results import header\n"),
    ("python -m repro.vllm_integration.gate --out DIR", "python -m repro.vllm_integration.gate.worker --out DIR"),
    ("repro.vllm_integration.gate_case.expected", "repro.vllm_integration.gate.case.expected"),
    ("repro.vllm_integration.plugin:register", "repro.vllm_integration.plugin:register"),  # keeps its name
    ("repro.vllm_integration.counters", "repro.vllm_integration.plugin.counters"),
    ("repro.fa3_model.predict, repro.vllm_integration", "repro.fa3_model.predict, repro.vllm_integration"),
    ("repro.pytest_options", "repro.pytest_options"),
]


@pytest.mark.parametrize(("text", "want"), BEFORE)
def test_names_of_moved_modules_are_rewritten_before_the_move(text, want):
    assert rewriter(True).text("x.py", text) == want


AFTER = [
    "from repro.report import results as report\n",  # the package repro.report, not the old module
    "from repro.case.spec import CaseSpec\n",
    "repro.case.spec.CaseSpec",
    "python -m repro.vllm_integration.gate.worker",
    "from repro.vllm_integration.gate import case as gate_case\n",
]


@pytest.mark.parametrize("text", AFTER + [w for _, w in BEFORE])
def test_new_names_stay_as_they_are(text):
    assert rewriter(False).text("x.py", text) == text


def test_old_names_merged_in_after_the_move_are_rewritten():
    r = rewriter(False)
    assert r.text("x.py", "from repro.report import header\n") == "from repro.report.results import header\n"
    assert r.text("x.md", "see repro.case.CaseSpec") == "see repro.case.spec.CaseSpec"
    assert r.text("x.md", "`python -m repro.vllm_integration.gate`") == "`python -m repro.vllm_integration.gate.worker`"


def test_an_import_of_new_modules_and_old_names_together_is_refused():
    with pytest.raises(relayout.Refused, match="old module or new package"):
        rewriter(False).text("x.py", "from repro.report import results, header\n")


def test_from_package_import_module_statements_are_split_per_new_package_with_their_comments():
    r = rewriter(True)
    src = "def f():\n    from repro import report, case_sets, __version__  # why: the CPU model\n"
    assert r.text("x.py", src) == (
        "def f():\n"
        "    from repro import __version__  # why: the CPU model\n"
        "    from repro.report import results as report  # why: the CPU model\n"
        "    from repro.case import sets as case_sets  # why: the CPU model\n"
    )
    src = "from repro.vllm_integration import audit, counters, plugin, gate_bench\n"
    assert r.text("x.py", src) == (
        "from repro.vllm_integration import plugin\n"
        "from repro.vllm_integration.plugin import audit, counters\n"
        "from repro.vllm_integration.gate import bench as gate_bench\n"
    )


def test_paths_are_rewritten_and_bare_names_only_in_the_drawing():
    r = rewriter(True)
    assert (
        r.text("x.md", "`repro/policy.py` and ../repro/case.py:12")
        == "`repro/judge/policy.py` and ../repro/case/spec.py:12"
    )
    assert r.text("x.md", "vllm_integration/gate.py, fa3_model/predict.py") == (
        "vllm_integration/gate/worker.py, fa3_model/predict.py"
    )
    assert r.text("x.md", "runner.py") == "runner.py"
    drawing = "text runner.py\n```\nruns runner.py and vllm_integration/plugin.py; conftest.py\n```\n"
    assert r.text(relayout.DOC, drawing) == (
        "text runner.py\n```\nruns run/runner.py and vllm_integration/plugin/; conftest.py\n```\n"
    )


def test_a_second_pass_changes_nothing():
    text = "".join(t + "\n" for t, _ in BEFORE) + "from repro import report, policy\n`repro/case.py`\n"
    once = rewriter(True).text("x.py", text)
    assert once != text and rewriter(False).text("x.py", once) == once


def test_the_table_is_refused_when_an_old_name_is_a_new_module_name():
    layout = [
        ("l", "repro", None, [relayout.same("repro/__init__.py"), relayout.move("repro/a.py", "repro/b.py")]),
        ("l", "repro/x", "doc", [relayout.move("repro/b.py", "repro/x/b.py")]),
    ]
    with pytest.raises(relayout.Refused):
        relayout.check_table(layout)
