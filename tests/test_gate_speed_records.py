"""`records --speed`: gate speed records side by side in one table, each phase computed again from the record's own
logs, so a benchmark is compared with its previous record on the same split."""

from __future__ import annotations

from repro.cli import main
from repro.vllm_integration.gate.speed import record_rows
from tests.records import RESULTS


def _row(rows, path):
    return next(r for r in rows if r["path"] == path)


def test_a_comparison_gives_a_row_per_path_and_a_gate_run_one_with_the_kept_reference_not_counted():
    paths = record_rows("p", RESULTS / "h200-paths-inductor-0.34.0")
    assert [r["path"] for r in paths] == ["new (cold)", "new (warm)", "kept (cold)", "kept (warm)"]
    assert _row(paths, "new (warm)")["processes"] == 8  # the kept reference ran no process
    assert _row(paths, "new (warm)")["forkserver"] is None and _row(paths, "kept (warm)")["forkserver"] == 0.0
    assert _row(paths, "new (warm)")["jit"] > 10 > _row(paths, "kept (warm)")["jit"]  # the ~/.triton miss, seen
    (warm,) = record_rows("w", RESULTS / "h200-readme-gate-8-warm")
    assert (warm["outcome"], warm["processes"]) == ("PASS", 8) and warm["jit"] < 5 and warm["forkserver"] > 0


def test_the_command_prints_one_table_and_refuses_what_is_no_speed_record(tmp_path, capsys):
    assert main(["records", "--speed", "h200-readme-gate-8-cold", "h200-readme-gate-8-warm"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 4 and "| jit |" in table[0] and table[2].startswith("| h200-readme-gate-8-cold | gate | PASS")
    root = tmp_path / "checkout"
    (root / "results").mkdir(parents=True)
    assert main(["records", "--root", str(root), "--speed", "h200-readme-gate-8-cold"]) == 2
    assert "no record h200-readme-gate-8-cold" in capsys.readouterr().err
    assert main(["records", "--speed", "h200-ci-line-3-n8"]) == 2  # a pytest record: no gate run, no comparison
    assert "neither a gate run" in capsys.readouterr().err
