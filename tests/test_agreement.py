"""`agree`: the CPU model's predicted verdicts against recorded GPU verdicts, verdict and descriptor agreement told
apart, and what `matrix` writes accepted as input."""

from __future__ import annotations

from tests.commands import main_in
from tests.records import RESULTS

H200_RUN = RESULTS / "h200-default" / "results.json"


def test_agree_accepts_what_matrix_writes(tmp_path):
    """Both commands through repro.cli.main in this process (tests/commands.py main_in): a TypeError would raise."""
    assert main_in(["matrix", "--json", str(tmp_path / "m.json"), "--model-sms", "16"], tmp_path).returncode == 0
    r = main_in(["agree", str(tmp_path / "m.json")], tmp_path)
    assert r.returncode == 2 and "no GPU run to compare with" in r.stderr  # predictions only: said, not a TypeError
    r = main_in(["agree", str(tmp_path / "m.json"), str(H200_RUN)], tmp_path)
    assert r.returncode == 0 and "left out" in r.stderr and "Verdicts agree in" in r.stdout


def test_agree_reports_verdict_and_descriptor_agreement_apart():
    from repro.report.agreement import Agreement, counts, markdown

    rows = [
        Agreement("a", "crash", None, "t48r12", "oob", "main", "t64r16", ("oob",)),  # one verdict, two passes
        Agreement("b", "oob", "combine", "t64r16", "oob", "combine", "t64r16", ("oob",)),
        Agreement("c", "clean", None, None, "clean", None, None, ("clean",)),  # a clean run names no pass
    ]
    assert counts(rows) == {"verdict": (3, 3), "descriptor": (1, 2), "kernel": (1, 1)}
    md = markdown(rows, ["x.json"])
    assert "Verdicts agree in 3 of 3 cases" in md and "Descriptors agree in 1 of 2 cases where the GPU named one" in md
    assert "| a | crash | - | t48r12 | oob | oob | main | t64r16 | yes | NO | - |" in md
