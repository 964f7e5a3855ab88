"""The CPU tier's benchmark (scripts/bench-tests.py) reads pytest's JUnit record into per-test and per-file seconds,
keeps the ten slowest, and compares a record with the previous one in one table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_tests", ROOT / "scripts" / "bench-tests.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="2.5"/>
<testcase classname="tests.test_a" name="test_two[x]" time="0.5"><skipped message="no GPU"/></testcase>
<testcase classname="tests.test_b.TestK" name="test_three" time="4.0"><failure message="boom"/></testcase>
<testcase classname="cases.test_c" name="test_four" time="1.0"/>
</testsuite></testsuites>"""


def test_the_junit_record_gives_seconds_per_test_and_per_file_and_the_slowest_first(tmp_path):
    bench = _bench()
    (tmp_path / "j.xml").write_text(JUNIT)
    rows = bench._tests(tmp_path / "j.xml")
    assert [(r["file"], r["outcome"]) for r in rows] == [
        ("tests/test_a.py", "passed"),
        ("tests/test_a.py", "skipped"),
        ("tests/test_b.py", "failure"),
        ("cases/test_c.py", "passed"),
    ]
    doc = bench.summarize(rows, 12.0, 1, {"cpus": 2, "cpu_model": "", "python": "3", "load_1_5_15": [1, 1, 1]}, None)
    assert doc["tests_s"] == 8.0 and doc["per_file_s"] == {"tests/test_b.py": 4.0, "tests/test_a.py": 3.0,
                                                           "cases/test_c.py": 1.0}  # fmt: skip
    assert doc["slowest"][0] == {"test": "tests/test_b.py::test_three", "s": 4.0}
    assert doc["counts"] == {"failure": 1, "passed": 2, "skipped": 1}
    assert "| `tests/test_b.py::test_three` | 4.0 |" in bench.markdown(doc)


def test_a_record_is_compared_with_the_previous_one_file_by_file():
    bench = _bench()
    old = {"date": "d1", "wall_s": 100.0, "tests_s": 80.0, "counts": {"passed": 3}, "machine": {"load_1_5_15": [4]},
           "per_file_s": {"tests/test_a.py": 60.0, "tests/test_gone.py": 20.0}}  # fmt: skip
    new = {"date": "d2", "wall_s": 50.0, "tests_s": 40.0, "counts": {"passed": 3}, "machine": {"load_1_5_15": [1]},
           "per_file_s": {"tests/test_a.py": 30.0, "tests/test_new.py": 10.0}}  # fmt: skip
    table = bench.compare(old, new)
    assert table.splitlines()[0] == "| | d1 | d2 | change |"
    assert "| wall (s) | 100.0 | 50.0 | -50% |" in table
    assert "| `tests/test_a.py` (s) | 60.0 | 30.0 | -50% |" in table
    assert (
        "| `tests/test_gone.py` (s) | 20.0 | 0 | -100% |" in table and "| `tests/test_new.py` (s) | 0 | 10.0 |" in table
    )
    assert "(no previous record)" in bench.compare(None, new)
