"""What `python -m repro gate` prints: verdicts.md's own lines (markdown(run, env), the no-GPU line under its
headline taken from the environment as verdicts.md takes it) up to its per-case tables, never a copy edited after."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.commands import main_in

ROOT = Path(__file__).resolve().parent.parent
NO_GPU = (
    "**No GPU: these builds have no compiled extensions (stand-ins?); their answer says nothing about a real vLLM**"
)


def _printed_from_verdicts_md(md: str) -> str:
    """verdicts.md without its environment table, up to its per-case tables: what the terminal shows."""
    without_env, n = re.subn(r"\| environment \| \|\n(\|.*\|\n)+\n", "", md, count=1)
    assert n == 1, md[:2000]
    return without_env.split("\n| case |")[0]


def test_the_gates_terminal_headline_is_verdicts_mds_own_lines_with_the_no_gpu_line_under_it(tmp_path):
    from tests.fake_vllm import write_fake_vllm

    build = write_fake_vllm(tmp_path / "good", "0.26.0", "good")
    r = main_in(["gate", "--no-installed", "--vllm", f"good={build}", "--out", str(tmp_path / "out")], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    md = (tmp_path / "out" / "verdicts.md").read_text()
    printed = "# vLLM gate: " + r.stdout.split("# vLLM gate: ", 1)[1].split("\nwritten: ")[0]
    assert printed == _printed_from_verdicts_md(md)
    assert printed.split("**Gate: PASS**", 1)[1].split("\n\n")[1] == NO_GPU
    assert printed.startswith("# vLLM gate: ") and "| build | role |" in printed and "| case |" not in printed


def test_the_gate_command_prints_the_reports_text_never_a_copy_it_edited():
    """cmd_gate's print takes gate_report.markdown's text as it is: no .replace/.split/slice on it (it once spliced
    the no-GPU caveat into markdown(run)'s text, beside markdown(run, env), which writes that line itself)."""
    tree = ast.parse((ROOT / "repro" / "cli" / "gate.py").read_text())
    edited = [
        ast.unparse(node)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Attribute, ast.Subscript))
        and isinstance(call := node.value, ast.Call)
        and ast.unparse(call.func).endswith("markdown")
    ]
    assert not edited, edited
