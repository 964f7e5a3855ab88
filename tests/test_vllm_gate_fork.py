"""The gate's pre-imported launcher on CPU, over stand-in vLLM builds (tests/fake_vllm.py): case processes forked from
a forkserver per build (the harness's one, repro.run.forkserver, as repro.vllm_integration.gate.forkserver uses it;
gate_launch) give the records the spawned ones give, a hang
is killed at its timeout with its whole group, a crash's exit code and log arrive, a case or build that needs a
variable at import time is launched plainly, and a forkserver that dies hands its build back to the plain launch,
each said in the record and the report."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from repro.contract.verdicts import CLEAN, CRASH, HANG
from repro.errors import ProtocolError
from repro.run import forkserver as fs
from repro.vllm_integration.gate import report as gate_report
from repro.vllm_integration.gate.case import GateCase, case_env
from repro.vllm_integration.gate.forkserver import differs
from repro.vllm_integration.gate.launch import FORK, SPAWN, Launcher, launcher_kind
from repro.vllm_integration.gate.modes import GateMode, parse_modes
from repro.vllm_integration.gate.process import run_case
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.releases.builds import CONTROL, UNDER_TEST, parse_builds
from tests.fake_vllm import BEHAVIOURS, write_fake_vllm
from tests.processes import gone

needs_entry_point = pytest.mark.skipif(
    not any(e.value.startswith("repro.") for e in importlib.metadata.entry_points(group="vllm.general_plugins")),
    reason="the repro plugin's entry point is not installed (pip install -e .)",
)


def _build(tmp_path, behaviour: str, role: str = UNDER_TEST, version: str = "0.26.0", label: str | None = None):
    prefix = write_fake_vllm(tmp_path / (label or behaviour), version, behaviour)
    return parse_builds(f"{label or behaviour}={prefix}", role, "REPRO_VLLM")[0]


def _record(r, logs) -> tuple:
    """What a case's record says, without where its logs were or how long it took."""
    ident = r.backend_identity or {}
    reason = re.sub(r"\d+(\.\d+)? s\b", "N s", r.reason.replace(str(logs), "LOGS"))
    return (r.verdict, r.evidence, r.kernel, r.descriptor, r.expected, r.returncode, r.stale_fields, reason,
            ident.get("counters"), ident.get("engine"), ident.get("acceptance"))  # fmt: skip


def _env(build, builds, tmp_path, **extra) -> dict[str, str]:
    return {**case_env(GateCase(build, GateMode.parse("plain")), builds, tmp_path / "a.json", None, lambda: 0), **extra}


@pytest.mark.slow  # the tier's longest test (conftest: started first)
@needs_entry_point
def test_fork_and_spawn_give_the_same_records_for_every_stand_in_behaviour(tmp_path):
    """Every behaviour of the stand-in the gate's tests use, in the audit and plain modes (and the poison mode for a
    healthy build and one whose builder never calls get_scheduler_metadata), with their references and attribution
    reruns: the same verdict, evidence, kernel, exit code, counters and engine on both launchers."""
    builds = [_build(tmp_path, b) for b in BEHAVIOURS if b not in ("hang", "slow")]
    poisoned = [b for b in builds if b.label in ("good", "no-sched")]
    # two runs per launcher: the poisoned builds in all three modes (one reference per build serves them all), the
    # others in audit and plain; every case and reference once
    groups = (([b for b in builds if b not in poisoned], "audit,plain"), (poisoned, "audit,plain,poison:int-max"))
    runs: dict[str, list] = {}
    for kind in (SPAWN, FORK):
        runs[kind] = [
            run_gate(bs, parse_modes(m), tmp_path / kind / str(i), jobs=2, timeout_s=120, self_control="none",
                     launcher=kind)
            for i, (bs, m) in enumerate(groups)
        ]  # fmt: skip
    got = {
        kind: {
            c.case_id: _record(r, tmp_path / kind / str(i))
            for i, run in enumerate(rs)
            for c, r in run.cases + run.references + run.attributions
        }
        for kind, rs in runs.items()
    }
    assert got[FORK] == got[SPAWN]
    # one attribution rerun: the stand-in that exits 1 after an illegal memory access (the aborted one names none)
    assert len(got[FORK]) == 3 * len(builds) + 1 + len(poisoned)
    assert sum("-poison-int-max" in k for k in got[FORK]) == len(poisoned)
    for spawned, forked in zip(runs[SPAWN], runs[FORK]):
        assert forked.outcome() == spawned.outcome() and forked.blind() == spawned.blind()
    for kind, rs in runs.items():
        for run in rs:
            assert {r.phases["launcher"] for _, r in run.cases + run.references + run.attributions} == {kind}
            assert all(s["launcher"] == kind and not s["notes"] for s in run.launches.values()), run.launches
    forked = runs[FORK][1]
    fs = forked.launches["good"]["forkserver"]
    # audit, plain, poison and the reference, each forked
    assert fs["driver"] == "not loaded" and fs["import_s"] > 0 and forked.launches["good"]["forked"] == 4
    assert all(gone(s["forkserver"]["pid"]) for r in runs[FORK] for s in r.launches.values())  # closed with the run
    plain = next(r for c, r in forked.cases if c.case_id.endswith("-good-under-test-plain"))
    assert plain.phases["preimported_s"] == fs["import_s"] and plain.phases["import"] < fs["import_s"]


@needs_entry_point
def test_a_forked_hang_is_killed_at_its_timeout_with_its_whole_group(tmp_path):
    build = _build(tmp_path, "hang")
    t0 = time.time()
    # a forked case reaches its hang (and the reference its end) in under a second: 5 s is the timeout that ends it
    run = run_gate([build], parse_modes("plain"), tmp_path / "logs", timeout_s=5, self_control="none", launcher=FORK)
    (case, res), (_, ref) = run.cases[0], run.references[0]
    assert res.verdict == HANG and res.phases["launcher"] == FORK and "no exit within 5 s" in res.reason
    assert ref.verdict == CLEAN and ref.phases["launcher"] == FORK
    assert 5 <= res.wall_s < 17 and time.time() - t0 < 60 and res.returncode == -signal.SIGKILL
    log = (tmp_path / "logs" / f"{case.case_id}.out.log").read_text()
    helper = int(re.search(r"stand-in hang: helper process (\d+)", log)[1])
    assert gone(helper)  # started by the case, in its process group: killed with it


@needs_entry_point
def test_a_forked_crash_keeps_its_exit_code_log_and_attribution(tmp_path):
    """A control that exits 1 after an illegal memory access and one its process aborts (SIGABRT): their exit codes
    and logs arrive, the launch-blocking rerun (started beside the plain case, CUDA_LAUNCH_BLOCKING set in the forked
    child) names the kernel; the build under test's self control is caught, forked too."""
    builds = [_build(tmp_path, "good")]
    builds += [_build(tmp_path, b, CONTROL, "0.25.1") for b in ("stale-crash", "abort")]
    run = run_gate(builds, parse_modes("plain"), tmp_path / "logs", jobs=2, timeout_s=120, launcher=FORK)
    by_id = {c.case_id.split("-vllm-")[1]: r for c, r in run.cases + run.attributions}
    crash = by_id["stale-crash-control-plain"]
    assert crash.verdict == CRASH and crash.returncode == 1 and crash.kernel == "combine"
    assert "CUDA_LAUNCH_BLOCKING" in crash.evidence and by_id["stale-crash-control-plain-launch-blocking"].kernel
    log = (tmp_path / "logs" / "stale_metadata-vllm-stale-crash-control-plain.out.log").read_text()
    assert "an illegal memory access was encountered" in log
    aborted = by_id["abort-control-plain"]
    assert aborted.returncode == -signal.SIGABRT and "-6" in aborted.reason, aborted.reason
    assert by_id["good-self-control-plain"].verdict == CRASH and by_id["good-under-test-plain"].verdict == CLEAN
    assert run.affected() == []  # the build under test clean; the aborted control is no verdict of its own
    assert {r.phases["launcher"] for r in by_id.values()} == {FORK}


def test_only_the_per_case_variables_may_differ_from_the_forkservers():
    launch = {"PYTHONPATH": "/b", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    late = {"CUDA_VISIBLE_DEVICES": "1", "CUDA_LAUNCH_BLOCKING": "1", "REPRO_REQUEST": "{}", "VLLM_CACHE_ROOT": "/c"}
    assert differs({**launch, **late}, launch) == []
    assert differs({**launch, "PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, launch) == [
        "PYTORCH_CUDA_ALLOC_CONF"
    ]
    assert differs({"PYTHONPATH": "/b", "LD_PRELOAD": "x.so"}, {"PYTHONPATH": "/b"}) == ["LD_PRELOAD"]
    read = ["CUDA_VISIBLE_DEVICES"]  # read while the forkserver imported: must equal the forkserver's value
    assert differs({**launch, "CUDA_VISIBLE_DEVICES": "1"}, {**launch, "CUDA_VISIBLE_DEVICES": "1"}, read) == []
    assert differs({**launch, "CUDA_VISIBLE_DEVICES": "2"}, {**launch, "CUDA_VISIBLE_DEVICES": "1"}, read) == read
    assert (
        launcher_kind(None, {}) == FORK and launcher_kind(None, {"REPRO_GATE_LAUNCHER": "spawn"}) == SPAWN
    )  # the default
    assert launcher_kind("spawn", {"REPRO_GATE_LAUNCHER": "fork"}) == SPAWN
    with pytest.raises(Exception, match="launcher"):
        launcher_kind("vfork", {})


@needs_entry_point
def test_a_case_whose_import_time_variable_differs_is_launched_plainly(tmp_path):
    """A forkserver started with another allocator setting than the case's (read when torch loads) cannot run it:
    the case is spawned and its record says which variable; the launch-blocking rerun differs only in a per-case
    variable and is forked."""
    build = _build(tmp_path, "good")
    launcher = Launcher(FORK, tmp_path / "logs")
    try:
        launcher.start(build, _env(build, [build], tmp_path, PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync"))
        res = run_case(
            GateCase(build, GateMode.parse("plain"), timeout_s=60), [build], tmp_path / "l", launcher=launcher
        )
        assert res.verdict == CLEAN and res.phases["launcher"] == SPAWN
        assert "PYTORCH_CUDA_ALLOC_CONF differ from the forkserver's environment" in res.phases["launch_note"]
        other = Launcher(FORK, tmp_path / "logs2")
        try:
            other.start(build, _env(build, [build], tmp_path))
            rerun = GateCase(build, GateMode.parse("plain"), launch_blocking=True, timeout_s=60)
            res = run_case(rerun, [build], tmp_path / "l2", launcher=other)
            assert res.verdict == CLEAN and res.phases["launcher"] == FORK and "launch_note" not in res.phases
        finally:
            other.close()
        notes = launcher.summary()["good"]["notes"]
        assert any("PYTORCH_CUDA_ALLOC_CONF" in n for n in notes), notes
    finally:
        launcher.close()


@needs_entry_point
def test_a_build_whose_import_reads_a_per_case_variable_forks_only_the_cases_that_keep_its_value(tmp_path):
    """A vLLM whose import reads CUDA_LAUNCH_BLOCKING (a value a forked case could no longer change): its forkserver
    says so; the plain case and the reference (the forkserver's value: unset) are forked, the launch-blocking rerun
    is spawned, and the kernel is still named. The report says which case was launched plainly and why."""
    build = _build(tmp_path, "stale-crash", CONTROL, "0.25.1")
    init = tmp_path / "stale-crash" / "vllm" / "__init__.py"
    init.write_text(init.read_text() + "\nBLOCKING_AT_IMPORT = os.environ.get('CUDA_LAUNCH_BLOCKING')\n")
    run = run_gate([build], parse_modes("plain"), tmp_path / "logs", timeout_s=60, self_control="none", launcher=FORK)
    (_, res), (_, ref), (rc, rerun) = run.cases[0], run.references[0], run.attributions[0]
    assert res.verdict == CRASH and res.kernel == "combine" and rerun.kernel == "combine"
    assert (res.phases["launcher"], ref.phases["launcher"], rerun.phases["launcher"]) == (FORK, FORK, SPAWN)
    assert "CUDA_LAUNCH_BLOCKING differ from the forkserver's environment" in rerun.phases["launch_note"]
    s = run.launches["stale-crash"]
    assert s["forkserver"]["read_late"] == ["CUDA_LAUNCH_BLOCKING"] and (s["forked"], s["spawned"]) == (2, 1)
    assert any("read CUDA_LAUNCH_BLOCKING while the forkserver imported" in n for n in s["notes"]), s["notes"]
    assert f"{rc.case_id}: launched plainly: CUDA_LAUNCH_BLOCKING" in gate_report.markdown(run)


@needs_entry_point
def test_a_forkserver_that_dies_hands_its_build_to_the_plain_launch(tmp_path):
    """Killed before a case: the case is spawned. Killed while a case ran: that case's process group is killed and
    the case runs again, spawned. Both are notes of the build."""
    build = _build(tmp_path, "slow")
    case = GateCase(build, GateMode.parse("plain"), timeout_s=60)
    launcher = Launcher(FORK, tmp_path / "logs")
    try:
        server = launcher.start(build, _env(build, [build], tmp_path))
        assert server.wait_ready()
        results = {}
        worker = threading.Thread(
            target=lambda: results.update(res=run_case(case, [build], tmp_path / "l", launcher=launcher))
        )
        worker.start()
        for _ in range(300):  # until the forkserver reported the forked case
            started = [e[fs.STARTED] for e in server._events.values() if fs.STARTED in e]
            if started:
                break
            time.sleep(0.1)
        child = started[0]["pid"]
        os.kill(server.proc.pid, signal.SIGKILL)
        worker.join(120)
        res = results["res"]
        assert res.verdict == CLEAN and res.phases["launcher"] == SPAWN and "died" in res.phases["launch_note"]
        assert gone(child)
        again = run_case(case, [build], tmp_path / "l3", launcher=launcher)
        assert again.verdict == CLEAN and again.phases["launcher"] == SPAWN
        notes = launcher.summary()["slow"]["notes"]
        assert any("forkserver died under" in n for n in notes) and any("status -9" in n for n in notes), notes
    finally:
        launcher.close()


def test_the_forkserver_refuses_what_would_break_a_forked_case(tmp_path, monkeypatch):
    """In-process: an import that sets a per-case variable, and CUDA started by torch, each refuse; one that reads a
    per-case variable is named in the READY record."""
    (tmp_path / "reads_late.py").write_text("import os\nX = os.getenv('CUDA_VISIBLE_DEVICES')\n")
    (tmp_path / "sets_late.py").write_text("import os\nos.environ['REPRO_PROBE'] = '1'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("REPRO_PROBE", raising=False)
    from repro.vllm_integration.plugin import counters  # noqa: PLC0415  the plugin's state in this test process

    monkeypatch.setattr(counters, "_installed", set())  # what earlier tests in this process installed is not ours
    late = frozenset({"CUDA_VISIBLE_DEVICES", "REPRO_PROBE"})
    facts, problems = fs.prepare(["json", "reads_late"], late)
    assert problems == [] and facts["read_late"] == ["CUDA_VISIBLE_DEVICES"]  # a case must keep its value to fork
    assert facts["driver"] == "not loaded" and type(os.environ) is os._Environ
    facts, problems = fs.prepare(["sets_late"], late)
    assert facts["env_set"] == {"REPRO_PROBE": "1"} and "set per-case variables: ['REPRO_PROBE']" in problems[0]
    monkeypatch.delenv("REPRO_PROBE")
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert fs.cuda_problem() == "torch initialised CUDA in the forkserver"
    assert "torch initialised CUDA" in fs.prepare(["json"], late)[1][0]


def test_the_forkserver_speaks_typed_records_only():
    rec = fs.decode(fs.encode(fs.STARTED, id=3, pid=42, at=1.0))
    assert rec == {"schema": fs.SCHEMA, "kind": "started", "id": 3, "pid": 42, "at": 1.0}
    for bad in (b"REPRO_RESULT {}", b'{"kind": "started"}', b'{"schema": 1, "kind": "launch"}', b"[1]"):
        with pytest.raises(ProtocolError):
            fs.decode(bad)
    with pytest.raises(ProtocolError):
        fs.encode("hello")


GATE_THAT_DIES = """
import json, sys, threading, time
from pathlib import Path
from repro.vllm_integration.releases.builds import parse_builds, UNDER_TEST
from repro.vllm_integration.gate.case import GateCase, case_env
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.launch import Launcher, FORK
from repro.vllm_integration.gate.process import run_case
tmp = Path(sys.argv[1])
b = parse_builds(f"hang={sys.argv[2]}", UNDER_TEST, "x")[0]
launcher = Launcher(FORK, tmp / "logs")
server = launcher.start(b, case_env(GateCase(b, GateMode.parse("plain")), [b], tmp / "a.json", None, lambda: 0))
case = GateCase(b, GateMode.parse("plain"), timeout_s=300)
threading.Thread(target=run_case, args=(case, [b], tmp / "l"), kwargs={"launcher": launcher}, daemon=True).start()
while not any("started" in e for e in server._events.values()):
    time.sleep(0.1)
child = next(e["started"]["pid"] for e in server._events.values() if "started" in e)
print(json.dumps({"forkserver": server.proc.pid, "case": child}), flush=True)
time.sleep(600)
"""


@needs_entry_point
def test_a_gate_that_is_killed_takes_its_forkserver_and_cases_with_it(tmp_path):
    """The forkserver reads EOF on its request pipe when the gate dies (SIGKILL: no cleanup ran) and kills its cases'
    groups before it ends: nothing is left on the GPU."""
    prefix = write_fake_vllm(tmp_path / "hang", "0.26.0", "hang")
    gate = subprocess.Popen(
        [sys.executable, "-c", GATE_THAT_DIES, str(tmp_path), str(prefix)], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = json.loads(gate.stdout.readline())
        for _ in range(100):  # the forked case got as far as its helper process
            logs = list((tmp_path / "l").glob("*.out.log"))
            if logs and "helper process" in logs[0].read_text():
                break
            time.sleep(0.1)
        helper = int(re.search(r"helper process (\d+)", logs[0].read_text())[1])
    finally:
        gate.kill()
        gate.wait()
    assert gone(pids["forkserver"], 10) and gone(pids["case"], 10) and gone(helper, 10)


@needs_entry_point
def test_a_kept_forkserver_serves_the_next_run_and_idles_out(tmp_path, monkeypatch, request):
    """--keep-forkserver: the first run starts the build's forkserver at a socket of its own; a second run with the
    same build and environment forks its cases from that one (no import), with the same records; another
    environment gets another forkserver; once the idle time passes without a run, the forkserver exits and its socket
    is gone."""
    import shutil
    import tempfile

    from repro.vllm_integration.gate import keep as gate_keep

    short = tempfile.mkdtemp(prefix="k", dir="/tmp")  # a Unix socket's path holds at most 107 bytes
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))  # outside tmp_path: not left in /tmp
    monkeypatch.setenv("XDG_RUNTIME_DIR", short)
    build = _build(tmp_path, "good")
    # the second run connects within a second of the first's end even on a loaded CI machine; the idle-out below
    # waits for it
    runs, idle = [], 8.0
    folders = (tmp_path / "r0", tmp_path / "elsewhere" / "r1")
    for i in range(2):
        if i:  # the second run from another folder, its logs a relative path (the forkserver's folder is the first's)
            folders[1].parent.mkdir()
            monkeypatch.chdir(folders[1].parent)
        logs = Path("r1") if i else folders[0]
        kw = dict(jobs=2, timeout_s=120, self_control="none", launcher=FORK, keep_forkserver=idle)
        runs.append(run_gate([build], parse_modes("plain"), logs, **kw))
    assert list(folders[1].glob("*-plain.channel.jsonl"))  # where the second run asked, not in the first's folder
    first, second = (r.launches[build.label]["forkserver"] for r in runs)
    assert first["kept"] == {"reused": False, "served": 1, "idle_s": idle}
    assert second["kept"] == {"reused": True, "served": 2, "idle_s": idle} and second["pid"] == first["pid"]
    assert [r.launches[build.label]["forked"] for r in runs] == [2, 2]  # the case and its reference, both forked
    records = [{c.case_id: _record(r, folders[i])[:4] for c, r in run.cases} for i, run in enumerate(runs)]
    assert records[0] == records[1] and all(v[0] == CLEAN for v in records[1].values())
    assert (folders[1] / f"forkserver-{build.label}.log").exists()  # the run's logs keep its import output
    monkeypatch.setenv("REPRO_GATE_PRELOAD", "json")  # another preload: not the same forkserver
    other = run_gate([build], parse_modes("plain"), tmp_path / "r2", **kw)
    pids = (first["pid"], other.launches[build.label]["forkserver"]["pid"])
    assert pids[0] != pids[1] and other.launches[build.label]["forkserver"]["kept"]["reused"] is False
    deadline = time.time() + idle + 15
    while time.time() < deadline and (list(gate_keep.socket_dir().glob("*.sock")) or not all(map(gone, pids))):
        time.sleep(0.2)
    assert not list(gate_keep.socket_dir().glob("*.sock")) and all(map(gone, pids))


@needs_entry_point
def test_the_forkserver_starts_before_the_gpu_probes_and_stops_when_they_fail(tmp_path, monkeypatch):
    """The forkserver's import (about 20 s of torch and vLLM on an H200 host) runs beside the run's GPU probes (the
    GPU's identity for kept references: a child importing torch; the free memory: nvidia-smi), not after them; a
    probe that fails, or a Ctrl-C in it, stops the forkserver just started."""
    from repro.vllm_integration.gate import run as gate_run
    from repro.vllm_integration.gate.cache import GateCache

    build, order, servers = _build(tmp_path, "good"), [], []

    class Watched(Launcher):
        def start(self, b, env):
            server = super().start(b, env)  # each case asks for its build's too: the first call starts it
            if server not in servers:
                order.append("forkserver started")
                servers.append(server)
            return server

    def probe(fails: bool):
        def gpu_identity() -> str:
            order.append("gpu probed")
            if fails:
                raise KeyboardInterrupt
            return "no GPU"

        return gpu_identity

    monkeypatch.setattr(gate_run, "Launcher", Watched)
    monkeypatch.setattr(gate_run, "gpu_identity", probe(fails=False))
    kw = dict(timeout_s=60, self_control="none", launcher=FORK, cache=GateCache(tmp_path / "cache"))
    run = run_gate([build], parse_modes("plain"), tmp_path / "ok", **kw)
    assert order == ["forkserver started", "gpu probed"]
    assert run.cases[0][1].verdict == CLEAN and run.cases[0][1].phases["launcher"] == FORK
    assert run.started_at > 0 and run.setup_s is None  # no command around it: run_gate alone says nothing of one

    order.clear()
    monkeypatch.setattr(gate_run, "gpu_identity", probe(fails=True))
    with pytest.raises(KeyboardInterrupt):
        run_gate([build], parse_modes("plain"), tmp_path / "stopped", **kw)
    assert order == ["forkserver started", "gpu probed"]
    proc = servers[-1].proc
    assert proc is not None and proc.wait(timeout=30) is not None  # stopped with the run, not left importing


@needs_entry_point
def test_the_report_parses_each_builds_sources_once_a_run(tmp_path, monkeypatch):
    """verdicts.md, results.json and the terminal's summary each show every build's source check, on one row per
    build, self control and form: the tree is parsed once a run (on the H200 the report took 8-10 s when each row of
    each report parsed it again)."""
    build, parsed = _build(tmp_path, "good"), []

    def counted(prefix):
        parsed.append(prefix)
        return check_tree(prefix)

    from repro.vllm_integration.releases.source_check import check_tree

    monkeypatch.setattr(gate_report, "check_tree", counted)
    run = run_gate([build], parse_modes("plain"), tmp_path / "logs", timeout_s=60, launcher=FORK)
    assert len({c.inject for c, _ in run.cases}) == 3  # the build's rows: itself and both self-control forms
    gate_report.write(run, tmp_path / "out", {})
    gate_report.markdown(run)
    assert parsed == [build.prefix]
    rows = json.loads((tmp_path / "out" / "results.json").read_text())["builds"]
    assert {r["source_check"] for r in rows} == {check_tree(build.prefix).verdict}


def test_a_kept_forkservers_build_identity_sees_one_module_edited_in_place(tmp_path):
    """A kept forkserver serves a later run only while the build's files are the ones it imported: an edit of one
    module deep in the package (a bisect's checkout, a mutant, a hand-made fix), which leaves the package folder's
    and its __init__.py's size and mtime as they were, is another build; a rerun on the same files is the same one."""
    from repro.vllm_integration.gate import keep as gate_keep

    build = _build(tmp_path, "good")
    before = gate_keep.build_identity(build)
    assert gate_keep.build_identity(build) == before
    deep = sorted(p for p in build.package_dir.rglob("*.py") if p.parent != build.package_dir)[0]
    stamps = [(p.stat().st_size, p.stat().st_mtime_ns) for p in (build.package_dir, build.package_dir / "__init__.py")]
    deep.write_text(deep.read_text() + "\n# edited in place\n")
    assert stamps == [
        (p.stat().st_size, p.stat().st_mtime_ns) for p in (build.package_dir, build.package_dir / "__init__.py")
    ]
    assert gate_keep.build_identity(build) != before


@needs_entry_point
def test_a_run_stopped_while_its_forkservers_start_leaves_none_running(tmp_path, monkeypatch):
    """Ctrl-C (or an error) while the second build's forkserver starts stops the first build's, which was importing:
    none is left running beside the command (the pytest tier runs the gate in its own process for the session)."""
    from repro.vllm_integration.gate import run as gate_run

    builds, servers = [_build(tmp_path, "good", label="a"), _build(tmp_path, "good", label="b")], []

    class StoppedAtTheSecond(Launcher):
        def start(self, b, env):
            if servers and b is not servers[0][0]:
                raise KeyboardInterrupt
            server = super().start(b, env)
            servers.append((b, server))
            return server

    monkeypatch.setattr(gate_run, "Launcher", StoppedAtTheSecond)
    t0 = time.time()
    with pytest.raises(KeyboardInterrupt):
        run_gate(builds, parse_modes("plain"), tmp_path / "logs", timeout_s=60, self_control="none", launcher=FORK)
    proc = servers[0][1].proc
    assert proc.poll() is not None and time.time() - t0 < 10  # stopped with the run, at once


def test_a_gate_forkserver_is_refused_for_each_thing_vllm_s_imports_did_to_it(monkeypatch):
    """The gate's --checks (gate.forkserver.problems): vLLM's environment cache on, its general plugins loaded, the
    plugin installed while importing: each is named, and nothing is named when none happened."""
    import sys
    import types

    from repro import entrypoints
    from repro.vllm_integration.gate.forkserver import problems

    envs, plugins = types.ModuleType("vllm.envs"), types.ModuleType("vllm.plugins")
    counters = types.ModuleType(entrypoints.PLUGIN_COUNTERS)
    for mod in (envs, plugins, counters):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    assert problems() == []
    envs._env_cache = {}
    assert problems() == ["vLLM's environment cache is on (enable_envs_cache): a case's variables would not be read"]
    del envs._env_cache
    plugins.plugins_loaded = True
    assert "loaded its general plugins" in problems()[0] and len(problems()) == 1
    plugins.plugins_loaded = False
    counters._installed = {"fa3"}
    assert problems() == ["the plugin installed ['fa3'] in the forkserver"]
