"""`python -m repro audit -- COMMAND`: any vLLM program run with the auditor in every vLLM process it starts, judged in
the gate's words from every process's report. Stand-ins: a person's script (tests/audit_standin.py) over the stand-in
vLLM of tests/fake_vllm.py, whose LLM loads the real plugin through its entry point, in every process layout users run
(the engine in-process, vLLM's multi-process engine by fork and by spawn, `LLM` twice, `vllm serve`'s engine core in a
process of its own, N engine processes at once, an engine process killed after its captures (judged from its last
snapshot) and one killed before it left any report). On the old code the
command does not exist: a person's REPRO_AUDIT=1 run over stale metadata exits 0, which the first test shows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from repro.vllm_integration.ci import command
from tests.commands import ROOT, isolated_env
from tests.fake_vllm import write_fake_vllm
from tests.processes import alive

SCRIPT = str(ROOT / "tests" / "audit_standin.py")


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("builds")
    names = ("good", "stale-quiet", "stale-descriptor", "abort", "piecewise", "other-method", "hang")
    return {b: write_fake_vllm(root / b, "0.34.0", b) for b in names}


def env_for(tmp_path: Path, build: Path | None, **extra: str) -> dict[str, str]:
    env = isolated_env(tmp_path, **extra)
    for k in ("REPRO_AUDIT", "REPRO_AUDIT_FILE", "REPRO_AUDIT_RUN", "REPRO_REQUEST", "VLLM_PLUGINS"):
        if k not in extra:
            env.pop(k, None)
    if build is not None:
        env["PYTHONPATH"] = os.pathsep.join((str(build), env["PYTHONPATH"]))
    return env


def audit(tmp_path: Path, build: Path | None, *args: str, out: str = "report", **extra: str):
    """`repro audit --out tmp_path/out ARGS` (ARGS: options, then -- and the command)."""
    cmd = [sys.executable, "-m", "repro", "audit", "--out", str(tmp_path / out), "--grace", "5", *args]
    r = subprocess.run(
        cmd, capture_output=True, text=True, timeout=240, cwd=tmp_path, env=env_for(tmp_path, build, **extra)
    )
    doc = (
        json.loads((tmp_path / out / "results.json").read_text())
        if (tmp_path / out / "results.json").exists()
        else None
    )
    return r, doc


def script(layout: str, *more: str) -> list[str]:
    return ["--", sys.executable, SCRIPT, layout, *more]


def test_without_the_command_a_REPRO_AUDIT_run_over_stale_metadata_exits_0(tmp_path, builds):
    """The issue's finding, kept: the audit file holds the stale fields, the script exits 0 (why `repro audit`)."""
    env = env_for(tmp_path, builds["stale-quiet"], REPRO_AUDIT="1", REPRO_AUDIT_FILE=str(tmp_path / "a.json"))
    r = subprocess.run([sys.executable, SCRIPT, "fork"], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and json.loads((tmp_path / "a.json").read_text())["mismatches"]


@pytest.mark.parametrize(
    ("layout", "engines"), [("inproc", 1), ("fork", 1), ("spawn", 1), ("twice", 2), ("serve", 1), ("dp:3", 3)]
)
def test_a_clean_run_passes_in_every_process_layout_with_what_it_rests_on(tmp_path, builds, layout, engines):
    r, doc = audit(tmp_path, builds["good"], *script(layout))
    assert r.returncode == 0, r.stderr
    j = doc["judgement"]
    assert doc["outcome"] == "PASS" and j["descriptor_checks"] > 0 and j["stale_fields"] == 0
    assert sum(1 for p in j["processes"] if p["checks"]) == engines and all(p["reported"] for p in j["processes"])
    managers = j["audited_by_manager"]  # FULL captures audited per capture manager, the speculator's among them
    assert managers == j["full_by_manager"] and any("Speculator" in m for m in managers)
    assert "repro audit: PASS (exit 0)" in r.stderr and "FULL captures by" in r.stderr
    assert (tmp_path / "report" / "verdicts.md").read_text().startswith("# repro audit\n\n**PASS**")


@pytest.mark.parametrize("layout", ["fork", "spawn", "inproc"])
def test_a_command_that_passes_over_stale_metadata_is_affected_each_descriptor_and_field_named(
    tmp_path, builds, layout
):
    r, doc = audit(tmp_path, builds["stale-quiet"], *script(layout))
    assert r.returncode == 1 and doc["outcome"] == "AFFECTED" and doc["command"]["returncode"] == 0
    stale = doc["judgement"]["stale"]
    assert "t32r8" in stale and any("seq_lens" in f for f in stale["t32r8"])
    assert "stale: t32r8: query_start_loc[2] (stale)" in r.stderr and "exit 0 (passed)" in r.stderr
    # each finding counted (a field found at a forward of the capture and again at its end), each field named once
    j = doc["judgement"]
    assert j["distinct_stale_fields"] == sum(map(len, stale.values())) <= j["stale_fields"]
    assert f"stale findings: {j['stale_fields']} (distinct fields: {j['distinct_stale_fields']})" in r.stderr


def test_metadata_built_for_another_descriptor_is_affected_with_the_descriptor_check_s_fields(tmp_path, builds):
    r, doc = audit(tmp_path, builds["stale-descriptor"], *script("spawn"))
    assert r.returncode == 1
    fields = doc["judgement"]["stale"]["FULL t32r8 q4"]
    assert any(f.startswith("num_reqs (object field) (stale-descriptor): 1 where its build gives 8") for f in fields)


def test_a_command_that_fails_with_nothing_stale_is_not_affected_and_its_status_is_kept_apart(tmp_path, builds):
    r, doc = audit(tmp_path, builds["good"], *script("fork", "eagle", "3"))
    assert r.returncode == 0 and doc["outcome"] == "PASS" and doc["command"]["returncode"] == 3
    assert "exit 3 (failed)" in r.stderr
    r, doc = audit(tmp_path, builds["good"], "--command-must-pass", *script("fork", "eagle", "3"), out="strict")
    assert r.returncode == 1 and doc["outcome"] == "PASS"


def test_an_engine_process_killed_before_any_report_is_cannot_vouch_naming_it(tmp_path, builds):
    r, doc = audit(tmp_path, builds["good"], *script("die-early"))
    assert r.returncode == 4 and doc["outcome"] == "CANNOT VOUCH"
    lost = [p for p in doc["judgement"]["processes"] if not p["reported"]]
    assert len(lost) == 1 and lost[0]["process"] == "EngineCore"
    assert f"pid {lost[0]['pid']} (EngineCore) installed the auditor and never reported" in r.stderr


@pytest.mark.parametrize(("build", "code"), [("good", 0), ("stale-quiet", 1)])
def test_an_engine_core_killed_after_its_captures_is_judged_from_its_last_snapshot(tmp_path, builds, build, code):
    """`vllm serve`'s shutdown force-kills its engine core (SIGKILL): what it checked is on disk from its snapshots,
    judged as a report (clean: PASS; stale: AFFECTED), the process said to be killed before its exit report."""
    r, doc = audit(tmp_path, builds[build], *script("die"))
    assert r.returncode == code and doc["outcome"] == ("PASS" if code == 0 else "AFFECTED"), r.stderr
    core = [p for p in doc["judgement"]["processes"] if p["process"] == "EngineCore"]
    assert len(core) == 1 and core[0]["reported"] and core[0]["checks"] > 0
    assert core[0]["snapshot"].startswith("no exit report (killed, or still running when read); last snapshot after ")
    assert (
        f"pid {core[0]['pid']} (EngineCore): no exit report (killed, or still running when read); last snapshot after"
        in r.stderr
    )
    assert "checks after" in r.stderr and "(1 by a snapshot only)" in r.stderr
    assert (
        "| snapshot only: no exit report (killed, or still running when read)"
        in (tmp_path / "report" / "verdicts.md").read_text()
    )
    assert not any(p["snapshot"] for p in doc["judgement"]["processes"] if p["process"] != "EngineCore")


def test_no_full_capture_audited_or_no_vllm_at_all_is_cannot_vouch_never_clean(tmp_path, builds):
    r, doc = audit(tmp_path, builds["piecewise"], *script("fork"))
    assert r.returncode == 4 and "no FULL CUDA graph capture was audited" in r.stderr
    r, doc = audit(tmp_path, None, "--", sys.executable, "-c", "pass", out="none")
    assert r.returncode == 4 and "no vLLM process reported an audit" in r.stderr


def test_another_method_than_the_one_expected_is_cannot_vouch_with_both_named(tmp_path, builds):
    r, doc = audit(tmp_path, builds["other-method"], "--expect-method", "eagle", *script("spawn"))
    assert r.returncode == 4
    assert "speculative method asked for: eagle; the model runner the plugin saw capturing ran: draft_model" in r.stderr
    r, doc = audit(tmp_path, builds["good"], "--expect-method", "eagle", *script("spawn"), out="same")
    assert r.returncode == 0 and doc["judgement"]["methods"] and "warning" not in r.stderr


@pytest.mark.parametrize("method", ["eagel", "", "  "])
def test_an_expected_method_vllm_never_names_or_an_empty_one_is_refused_before_the_command_runs(tmp_path, method):
    r, doc = audit(tmp_path, None, "--expect-method", method, *script("inproc"))
    assert (
        r.returncode == 2
        and "--expect-method" in r.stderr
        and "give a method name" in r.stderr
        or ("not a speculative method vLLM names: dflash, draft_model" in r.stderr)
    )
    assert doc is None and not (tmp_path / "report").exists()  # nothing ran, nothing written


def test_an_mtp_model_type_or_a_name_in_capitals_is_compared_as_vllm_reports_it():
    from repro.vllm_integration.ci.judge import expected_method

    assert expected_method("deepseek_mtp")[0] == "mtp" and "compared as mtp" in expected_method("deepseek_mtp")[1]
    assert [expected_method(m) for m in ("EAGLE", "draft_model", None)] == [("eagle", None), ("draft_model", None),
                                                                           (None, None)]  # fmt: skip


@pytest.mark.parametrize("name", ["results.json", "verdicts.md", ".repro-report.json", "audit/x.xml"])
def test_a_junit_file_onto_one_the_report_folder_holds_is_refused_and_nothing_is_written(tmp_path, builds, name):
    out = tmp_path / "report"
    out.mkdir()  # new and empty, as --out may be
    r, doc = audit(tmp_path, builds["good"], "--junit", str(out / name), *script("inproc"))
    assert r.returncode == 2 and "is a file this command writes into" in r.stderr
    assert list(out.iterdir()) == []


def test_an_empty_junit_name_is_refused(tmp_path, builds):
    r, _ = audit(tmp_path, builds["good"], "--junit", "", *script("inproc"))
    assert r.returncode == 2 and "--junit '': give a file name" in r.stderr


def test_expected_speculator_and_capture_manager_classes_are_compared_where_recorded(tmp_path, builds):
    r, _ = audit(tmp_path, builds["good"], "--expect-speculator", "EagleSpeculator", *script("fork"))
    assert r.returncode == 4 and "speculator class expected: EagleSpeculator; vLLM ran: Speculator" in r.stderr
    r, _ = audit(tmp_path, builds["good"], "--expect-manager", "SpeculatorCudaGraphManager", *script("fork"), out="m")
    assert r.returncode == 0


def test_strict_stops_the_engine_at_the_first_stale_capture_its_report_written_first(tmp_path, builds):
    r, doc = audit(tmp_path, builds["stale-quiet"], "--strict", *script("spawn"))
    assert r.returncode == 1 and "StaleCapture: strict audit" in r.stderr
    j = doc["judgement"]  # the engine stopped at the draft's first FULL capture: the target's and that one audited
    assert sum(j["audited_by_manager"].values()) < 6 and j["stale_fields"] > 0


@pytest.mark.parametrize(
    "bound", [["--timeout", "nan"], ["--timeout", "inf"], ["--timeout", "0"], ["--grace", "-1"], ["--grace", "nan"]]
)
def test_a_timeout_or_grace_that_bounds_nothing_is_refused_before_the_command_starts(tmp_path, bound):
    """nan compares false with everything: `--timeout nan` once ran the command unbounded."""
    marker = tmp_path / "ran"
    r, _ = audit(tmp_path, None, *bound, "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "a number of seconds up to" in r.stderr, r.stderr
    assert not marker.exists() and not (tmp_path / "report").exists()


def test_a_vllm_plugins_that_leaves_the_auditor_out_or_a_request_set_is_refused_and_nothing_written(tmp_path, builds):
    for extra in ({"VLLM_PLUGINS": "other_plugin"}, {"VLLM_PLUGINS": ""}, {"REPRO_REQUEST": "{}"}):
        r, _ = audit(tmp_path, builds["good"], *script("fork"), **extra)
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and not (tmp_path / "report").exists(), r.stderr
    r, _ = audit(tmp_path, builds["good"], *script("fork"), VLLM_PLUGINS="x,repro_freshness_audit")
    assert r.returncode == 0


def test_the_timeout_stops_the_command_s_whole_process_group_and_cannot_vouch(tmp_path, builds):
    r, doc = audit(tmp_path, builds["hang"], "--timeout", "8", *script("inproc"))
    assert r.returncode == 4 and doc["command"]["timed_out"] and "stopped at its timeout" in r.stderr
    helper = int(next(line.split()[-1] for line in r.stdout.splitlines() if "helper process" in line))
    time.sleep(0.5)
    assert not Path(f"/proc/{helper}").exists() or "Z" in Path(f"/proc/{helper}/stat").read_text().split()[2]


@pytest.mark.parametrize(
    ("sig", "times"), [(signal.SIGINT, 1), (signal.SIGTERM, 1), (signal.SIGHUP, 1), (signal.SIGHUP, 2)]
)
def test_ctrl_c_sigterm_or_a_hang_up_stops_the_command_and_marks_the_report_folder_interrupted(
    tmp_path, builds, sig, times
):
    """Ctrl-C, a cancelled CI job (SIGTERM) and a closed terminal or ssh session (SIGHUP, which a closing terminal
    may send twice: the second arrives while the command is being stopped) alike: the command's whole session
    stopped, nothing left running, the folder marked interrupted."""
    cmd = [sys.executable, "-m", "repro", "audit", "--out", str(tmp_path / "r"), "--grace", "2", *script("inproc")]
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env_for(tmp_path, builds["hang"]), stdout=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    while "helper process" not in line:
        line = p.stdout.readline()
    helper = int(line.split()[-1])
    for k in range(times):
        if k:
            time.sleep(0.5)  # within the 2 s grace of the stop the first one began
        p.send_signal(sig)
    assert p.wait(timeout=60) == 130
    assert (tmp_path / "r" / "INTERRUPTED").exists() and not (tmp_path / "r" / "results.json").exists()
    time.sleep(0.5)
    assert not Path(f"/proc/{helper}").exists() or "Z" in Path(f"/proc/{helper}/stat").read_text().split()[2]


def test_a_hang_up_the_caller_ignores_nohup_leaves_the_command_running_to_its_end(tmp_path):
    """`nohup repro audit ... &`: SIGHUP stays ignored (the handler is installed only where it was not), the command
    runs to its end and is judged (no vLLM in it: CANNOT VOUCH), the folder not marked interrupted."""
    marker = tmp_path / "done"
    code = f"import time; time.sleep(2); open({str(marker)!r}, 'w')"
    cmd = [sys.executable, "-m", "repro", "audit", "--out", str(tmp_path / "r"), "--", sys.executable, "-c", code]
    nohup = lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN)  # noqa: E731
    p = subprocess.Popen(cmd, cwd=tmp_path, env=env_for(tmp_path, None), preexec_fn=nohup, stderr=subprocess.PIPE)
    time.sleep(1.0)
    p.send_signal(signal.SIGHUP)
    assert p.wait(timeout=60) == 4 and marker.exists()
    assert not (tmp_path / "r" / "INTERRUPTED").exists() and (tmp_path / "r" / "results.json").exists()


def test_junit_on_request_and_a_report_folder_that_is_not_empty_refused(tmp_path, builds):
    r, _ = audit(tmp_path, builds["stale-quiet"], "--junit", str(tmp_path / "audit.xml"), *script("fork"))
    xml = (tmp_path / "audit.xml").read_text()
    assert r.returncode == 1 and 'failures="2"' in xml and "prefill_cudagraph_manager of Speculator" in xml
    r, _ = audit(tmp_path, builds["good"], *script("fork"))
    assert r.returncode == 2 and "holds a report of an earlier run" in r.stderr


LEFT = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
"""


def test_what_the_command_left_running_in_its_session_is_stopped_before_any_report_is_read(tmp_path, capfd):
    """A process still running when the command ends (an engine core shutting down, a server it started) would be
    judged from its snapshot while it can still find something stale: it is stopped first, SIGTERM then SIGKILL."""
    pid_file = tmp_path / "child.pid"
    t0 = time.monotonic()
    ran = command.run([sys.executable, "-c", LEFT, str(pid_file)], tmp_path / "folder", timeout=60, grace=2.0)
    child = int(pid_file.read_text())
    assert ran.status.returncode == 0 and time.monotonic() - t0 < 30
    assert not alive(child)  # a zombie waiting for a reaper counts as ended
    assert "left processes running in its session: stopped" in capfd.readouterr().err
