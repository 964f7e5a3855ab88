"""The two-GPU check: each xdist worker on a GPU of its own, read from JUnit properties recorded inside cases."""

from repro.case.spec import CaseSpec
from repro.judge.classify import classify
from repro.report.xdist import check_junit
from tests.records import RESULTS

RECORDED = RESULTS / "h200x2-xdist"


def _junit(tmp_path, rows):
    cases = "".join(
        f'<testcase name="t{i}" time="1.0"><properties><property name="xdist_worker" value="{w}"/>'
        f'<property name="gpu_uuid" value="{u}"/><property name="pinned_device" value="{p}"/></properties></testcase>'
        for i, (w, u, p) in enumerate(rows)
    )
    path = tmp_path / "j.xml"
    path.write_text(f'<testsuites><testsuite name="pytest" time="3.5">{cases}</testsuite></testsuites>')
    return path


def test_recorded_two_gpu_run_is_pinned_one_worker_per_gpu():
    rep = check_junit(RECORDED / "junit-n2.xml", expect_workers=2)
    assert rep.ok, rep.problems
    assert len(set.union(*rep.workers.values())) == 2


def test_shared_gpu_and_wrong_pin_are_reported(tmp_path):
    rep = check_junit(_junit(tmp_path, [("gw0", "GPU-a", "GPU-a"), ("gw1", "a", "GPU-b")]), expect_workers=2)
    assert not rep.ok
    assert any("share GPU a" in p for p in rep.problems)
    assert any("gw1 was pinned to ['b'] but ran on ['a']" in p for p in rep.problems)


def test_worker_on_two_gpus_and_missing_workers(tmp_path):
    rep = check_junit(_junit(tmp_path, [("gw0", "a", "None"), ("gw0", "b", "None")]), expect_workers=2)
    assert any("ran on 2 GPUs" in p for p in rep.problems)
    assert any("expected 2 workers" in p for p in rep.problems)
    assert rep.suite_seconds == 3.5


def test_device_line_is_read_even_when_the_case_crashes():
    spec = CaseSpec("vllm", "stale")
    out = 'REPRO_DEVICE {"gpu_uuid": "c84e-1"}\nREPRO_PASS {"descriptor": "t32r8"}\nCUDA error: an illegal memory access\n'
    r = classify(spec, out, 1, False, None, 3.0)
    assert r.verdict == "crash" and r.gpu_uuid == "c84e-1"


def test_recorded_one_gpu_run_is_flagged_as_shared():
    """Negative control recorded on one H200: two workers, one GPU. Crashing cases named their GPU too."""
    rep = check_junit(RESULTS / "h200-xdist-1gpu" / "junit-1gpu-n2.xml", expect_workers=2)
    assert not rep.ok and any("share GPU" in p for p in rep.problems)
    assert rep.cases == {"gw0": 4, "gw1": 4}  # all 8 cases, the 4 crashing ones included
