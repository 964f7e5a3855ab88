"""`pytest --repro-audit` (repro.vllm_integration.ci.pytest_audit) in another project's suite: a stand-in vLLM-style
suite run with pytester over the stand-in vLLM of tests/fake_vllm.py (its LLM loads the real plugin through its entry
point), in pytest's own process and in spawned engine processes, plainly and under xdist: a test during which a FULL
capture was stale fails naming the descriptor and fields, a test with no FULL capture is "not judged", another method
than the one a test asks for fails it, and the session summary speaks the gate's words."""

from __future__ import annotations

import os

import pytest

from tests.commands import ROOT
from tests.fake_vllm import write_fake_vllm

pytest_plugins = ["pytester"]
PLUGIN = "repro.vllm_integration.ci.pytest_audit"

SUITE = """
import multiprocessing
import pytest
from vllm import LLM, SamplingParams


def engine(method="eagle"):
    llm = LLM(model="tiny", speculative_config={"method": method, "num_speculative_tokens": 3},
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))


def test_engine_in_process():
    engine()


def test_engine_spawned():
    p = multiprocessing.get_context("spawn").Process(target=engine, name="EngineCore")
    p.start()
    p.join()
    assert p.exitcode == 0


def test_eager_engine():
    LLM(model="tiny", enforce_eager=True)


def test_no_vllm():
    assert True


@pytest.mark.repro_audit_method("draft_model")
def test_method_asked_for():
    engine("eagle")
"""


@pytest.fixture
def suite(pytester, monkeypatch, tmp_path_factory):
    def make(behaviour: str):
        build = write_fake_vllm(tmp_path_factory.mktemp(behaviour), "0.34.0", behaviour)
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(build), str(ROOT), os.environ.get("PYTHONPATH", ""))))
        for k in ("REPRO_AUDIT", "REPRO_AUDIT_FILE", "REPRO_AUDIT_RUN", "REPRO_REQUEST", "VLLM_PLUGINS"):
            monkeypatch.delenv(k, raising=False)
        pytester.makepyfile(test_vllm_style=SUITE)
        return pytester

    return make


def _run(p, *args):
    return p.runpytest_subprocess("-p", PLUGIN, "-p", "no:cacheprovider", "-p", "no:randomly", *args, timeout=240)


def _audited(p, *args, passed: int, failed: int):
    """The suite run with --repro-audit (in one process unless ARGS say otherwise): its tests' outcomes checked,
    the run returned."""
    r = _run(p, *(args or ("-p", "no:xdist")), "--repro-audit")
    r.assert_outcomes(passed=passed, failed=failed)
    return r


@pytest.fixture
def one_plain_test(pytester, monkeypatch):
    """A suite of one test that runs no vLLM, the repro checkout importable."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(ROOT), os.environ.get("PYTHONPATH", ""))))
    pytester.makepyfile(test_plain="def test_one():\n    assert True\n")
    return pytester


def test_off_unless_asked(suite):
    r = _run(suite("stale-quiet"), "-p", "no:xdist")  # the plugin loaded, its option not given: every test passes
    r.assert_outcomes(passed=5)
    assert r.ret == 0 and "repro audit" not in r.stdout.str()


def test_stale_tests_fail_naming_descriptor_and_fields_others_not_judged(suite):
    r = _audited(suite("stale-quiet"), passed=2, failed=3)
    out = r.stdout.str()
    assert "repro audit: stale during test_vllm_style.py::test_engine_in_process" in out
    assert "repro audit: stale during test_vllm_style.py::test_engine_spawned" in out
    assert "t32r8: query_start_loc[2] (stale): 0 where its build gives 8" in out
    assert "repro audit: AFFECTED" in out and "not judged: test_vllm_style.py::test_eager_engine" in out
    # pytest's own process (the in-process engine) writes snapshots into a test's file: judged in-process, never
    # as a process killed before its exit report
    assert "judged from its snapshot" not in out
    assert r.ret == 1


def test_a_clean_build_passes_with_the_method_mismatch_failing_its_test(suite):
    out = _audited(suite("good"), passed=4, failed=1).stdout.str()
    assert "speculative method asked for: draft_model; the model runner the plugin saw capturing ran: eagle" in out
    assert "repro audit: CANNOT VOUCH: 2 test(s) judged, 0 stale, 2 not judged" in out
    # what the replay check judged over the session: its stand-in engines replay no graph, and it says so
    assert "replay check: 0 judged of 0 replays seen (nothing checked at replay" in out


def test_under_xdist_each_worker_judges_its_tests_and_the_controller_sums_them(suite):
    out = _audited(suite("stale-quiet"), "-n", "2", passed=2, failed=3).stdout.str()
    assert "repro audit: AFFECTED: 3 test(s) judged, 3 stale, 2 not judged" in out
    assert "stale: test_vllm_style.py::test_engine_spawned" in out
    assert "replay check: 0 judged of 0 replays seen" in out  # the workers' counts summed by the controller


def test_nothing_judged_is_cannot_vouch_and_fails_the_session(one_plain_test):
    r = _run(one_plain_test, "-p", "no:xdist", "--repro-audit")
    assert r.ret == 1 and "repro audit: CANNOT VOUCH: 0 test(s) judged" in r.stdout.str()


def test_a_vllm_plugins_that_leaves_the_auditor_out_is_a_usage_error(one_plain_test, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "other")
    r = _run(one_plain_test, "-p", "no:xdist", "--repro-audit")
    assert r.ret == pytest.ExitCode.USAGE_ERROR and "leaves out the auditor's plugin" in r.stderr.str()


@pytest.mark.parametrize("xdist", [("-p", "no:xdist"), ("-n", "2")])
def test_under_repro_audit_the_per_test_failures_and_the_command_s_answer_both(suite, xdist):
    """`repro audit -- pytest --repro-audit`: each test judged (stale ones fail), and every test's reports, the
    in-process engine's findings included, forwarded to the command's audit file: AFFECTED, each descriptor named."""
    import json
    import subprocess
    import sys

    p = suite("stale-quiet")
    cmd = [sys.executable, "-m", "repro", "audit", "--out", "report", "--grace", "5", "--", sys.executable, "-m",
           "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", *xdist, "--repro-audit", "test_vllm_style.py"]  # fmt: skip
    r = subprocess.run(cmd, cwd=p.path, capture_output=True, text=True, timeout=240)
    assert "FAILED test_vllm_style.py::test_engine_spawned - repro audit: stale" in r.stdout
    doc = json.loads((p.path / "report" / "results.json").read_text())
    assert r.returncode == 1 and doc["outcome"] == "AFFECTED" and doc["command"]["returncode"] == 1
    assert "t32r8" in doc["judgement"]["stale"]
    in_process = [q for q in doc["judgement"]["processes"] if q["process"] == "pytest (in-process engine)"]
    assert in_process and all(q["reported"] for q in doc["judgement"]["processes"])


def test_the_sessions_replay_and_refresh_counts_are_the_sum_of_its_tests():
    from repro.vllm_integration.ci.pytest_audit import summary

    one = {"status": "clean", "reasons": [], "replays_seen": 12, "replays_judged": 3, "refreshes_judged": 5}
    two = {"status": "clean", "reasons": [], "replays_seen": 4, "replays_judged": 0, "refreshes_judged": 0}
    s = summary({"t1": one, "t2": two, "t3": {"status": "not judged", "reasons": []}}, [])
    assert (s["replays_seen"], s["replays_judged"], s["refreshes_judged"]) == (16, 3, 5) and s["outcome"] == "PASS"


KILLED_SUITE = """
import multiprocessing, os, signal
from vllm import LLM, SamplingParams


def engine_then_killed():
    llm = LLM(model="tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 3},
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))
    os.kill(os.getpid(), signal.SIGKILL)  # as `vllm serve`'s shutdown force-kills its engine core


def test_engine_killed():
    p = multiprocessing.get_context("spawn").Process(target=engine_then_killed, name="EngineCore")
    p.start()
    p.join()
    assert p.exitcode == -signal.SIGKILL
"""


def test_an_engine_killed_after_its_captures_is_judged_from_its_snapshot_never_as_unreported(suite):
    p = suite("good")
    p.makepyfile(test_vllm_style=KILLED_SUITE)
    r = _audited(p, passed=1, failed=0)
    out = r.stdout.str()
    assert r.ret == 0 and "repro audit: PASS: 1 test(s) judged, 0 stale" in out and "never reported" not in out
    assert "judged from its snapshot: test_vllm_style.py::test_engine_killed: pid " in out
    assert (
        "(EngineCore): no exit report (killed, or still running when read); last snapshot after a FULL capture" in out
    )


FORKED_AFTER_IN_PROCESS = """
import multiprocessing
from vllm import LLM, SamplingParams


def engine():
    llm = LLM(model="tiny", speculative_config={"method": "eagle", "num_speculative_tokens": 3},
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))


def test_a_in_process():
    engine()  # the auditor installs in pytest's own process, this test's audit file its destination


def test_b_forked():
    p = multiprocessing.get_context("fork").Process(target=engine, name="EngineCore")
    p.start()
    p.join()
    assert p.exitcode == 0
"""


@pytest.mark.parametrize(("behaviour", "passed", "failed"), [("good", 2, 0), ("stale-quiet", 0, 2)])
def test_an_engine_forked_in_a_later_test_reports_to_that_test_not_to_the_one_that_installed_the_auditor(
    pytester, monkeypatch, tmp_path_factory, behaviour, passed, failed
):
    """vLLM's engine core forked from pytest's process (vLLM used as a library) inherits an auditor installed there
    during an earlier test: its reports must reach its own test's file, as its start mark does (on the H100 the last
    test of a clean run was CANNOT VOUCH, its engine's reports filed under the first test)."""
    build = write_fake_vllm(tmp_path_factory.mktemp(behaviour), "0.34.0", behaviour)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(build), str(ROOT), os.environ.get("PYTHONPATH", ""))))
    for k in ("REPRO_AUDIT", "REPRO_AUDIT_FILE", "REPRO_AUDIT_RUN", "REPRO_REQUEST", "VLLM_PLUGINS"):
        monkeypatch.delenv(k, raising=False)
    pytester.makepyfile(test_forked=FORKED_AFTER_IN_PROCESS)
    r = _audited(pytester, passed=passed, failed=failed)
    out = r.stdout.str()
    assert "cannot vouch: test_forked.py::test_b_forked" not in out  # its engine's reports reached its own folder
    if behaviour == "stale-quiet":
        assert "repro audit: stale during test_forked.py::test_b_forked" in out
        assert "repro audit: AFFECTED: 2 test(s) judged, 2 stale, 0 not judged" in out
    else:
        assert "repro audit: PASS: 2 test(s) judged, 0 stale, 0 not judged" in out


METHODS_ACROSS_A_FORK = """
import multiprocessing
import pytest
from vllm import LLM, SamplingParams


def engine(method):
    llm = LLM(model="tiny", speculative_config={"method": method, "num_speculative_tokens": 3},
              compilation_config={"cudagraph_mode": "FULL_AND_PIECEWISE"})
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))


@pytest.mark.repro_audit_method("eagle")
def test_a_eagle_in_process():
    engine("eagle")


@pytest.mark.repro_audit_method("draft_model")
def test_b_draft_model_forked():
    p = multiprocessing.get_context("fork").Process(target=engine, args=("draft_model",), name="EngineCore")
    p.start()
    p.join()
    assert p.exitcode == 0


def test_c_eager_forked():
    p = multiprocessing.get_context("fork").Process(target=lambda: LLM(model="tiny", enforce_eager=True))
    p.start()
    p.join()
"""


def test_a_forked_engine_reports_its_own_counts_not_those_it_inherited(pytester, monkeypatch, tmp_path_factory):
    """A fork child inherits its parent's counters: the method pytest's process ran, the captures it audited. Its
    report says what it did itself, so a later test's draft_model engine is not judged as eagle, and an eager engine
    is not vouched for on captures it never made."""
    build = write_fake_vllm(tmp_path_factory.mktemp("good"), "0.34.0", "good")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join((str(build), str(ROOT), os.environ.get("PYTHONPATH", ""))))
    for k in ("REPRO_AUDIT", "REPRO_AUDIT_FILE", "REPRO_AUDIT_RUN", "REPRO_REQUEST", "VLLM_PLUGINS"):
        monkeypatch.delenv(k, raising=False)
    pytester.makepyfile(test_methods=METHODS_ACROSS_A_FORK)
    out = _audited(pytester, passed=3, failed=0).stdout.str()
    assert "speculative method asked for: draft_model" not in out
    assert "not judged: test_methods.py::test_c_eager_forked" in out


@pytest.mark.parametrize(("option", "said"), [("--repro-audit-method=eagel", "not a speculative method vLLM names"),
                                               ("--repro-audit-method=", "give a method name"),
                                               ("--repro-audit-dir=", "--repro-audit-dir '': give a new or empty folder")])  # fmt: skip
def test_a_method_typo_or_an_empty_value_is_a_usage_error_before_any_test_runs(one_plain_test, option, said):
    r = _run(one_plain_test, "-p", "no:xdist", "--repro-audit", option)
    assert r.ret == pytest.ExitCode.USAGE_ERROR and said in r.stderr.str()
