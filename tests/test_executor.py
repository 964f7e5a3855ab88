"""The forkserver executor's process management with stand-in workers: output to the case's log, the case's own
environment, exit codes, a timeout that kills the case and what it started, and the runner's verdicts on top."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from repro.case.spec import CaseSpec
from repro.contract.verdicts import CLEAN, CRASH, ERROR, HANG, OOB
from repro.run.executor import ForkExecutor, WarmPool
from repro.run.process import case_env
from repro.run.runner import case_logs, make_executor, memcheck_launch_env, run_process
from tests.processes import gone, group_alive

STANDIN_TARGETS = frozenset(f"tests.standin_worker:{f}" for f in ("clean", "hang", "crash", "boom", "phased"))


def forkserver(spares: int = 4) -> ForkExecutor:
    """The harness's forkserver as a command starts it, preloading and running the stand-in worker."""
    return ForkExecutor(case_env(), preload=("tests.standin_worker",), spares=spares, targets=STANDIN_TARGETS)


@pytest.fixture(scope="module")
def server():
    ex = forkserver()
    yield ex
    ex.close()


def test_output_environment_and_exit_code(server, tmp_path):
    out = tmp_path / "c.out.log"
    run = server.run("tests.standin_worker:clean", ["x"], {**case_env(), "STANDIN_ENV": "mine"}, out, 60)
    text = out.read_text()
    assert run.returncode == 0 and not run.timed_out and "stand-in x" in text and "env mine" in text
    assert f"pid {os.getpid()}" not in text  # its own process


def test_timeout_kills_the_case_and_its_children(server, tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    t0 = time.time()
    run = server.run("tests.standin_worker:hang", [str(pidfile)], case_env(), tmp_path / "h.log", 3)
    assert run.timed_out and time.time() - t0 < 30
    assert gone(int(pidfile.read_text()))  # no orphan left behind


def test_verdicts_through_the_runner(server, tmp_path):
    spec = CaseSpec("vllm", "stale", timeout_s=3)
    env = case_env()
    verdicts = {}
    for fn in ("clean", "crash", "boom", "hang"):
        argv = [str(tmp_path / "pid")] if fn == "hang" else ["y"]
        res, _ = run_process(spec, [], env, tmp_path, False, server, (f"tests.standin_worker:{fn}", argv))
        verdicts[fn] = res.verdict
    assert verdicts == {"clean": CLEAN, "crash": CRASH, "boom": ERROR, "hang": HANG}


def test_executor_names():
    assert make_executor("process") is None and isinstance(make_executor("forkserver"), ForkExecutor)
    with pytest.raises(Exception, match="unknown executor"):
        make_executor("threads")


def test_both_paths_side_by_side_give_the_same_verdicts(tmp_path, monkeypatch):
    """The benchmark's machinery, every path (process, forkserver, repro server) on one matrix whose cases end in
    different verdicts on any machine: no CUDA device visible while an MPS client's variable is set is an error the
    worker raises in the case process (only if the case's environment reached it), a MIG case with no slice is a skip
    the parent decides. Each path must give each case its own verdict; the diff is then computed, and a changed
    verdict shows up in it."""
    from repro.case.spec import SmConfig
    from repro.contract.verdicts import SKIP
    from repro.report.benchmark import compare_executors, paths_markdown

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU for the case processes, GPU machine or not
    monkeypatch.setenv("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "50")  # the worker: an MPS client without a device
    specs = [
        CaseSpec("vllm", "stale", timeout_s=120),
        CaseSpec("vllm", "fresh", timeout_s=120),
        CaseSpec("vllm", "stale", sm=SmConfig("mig"), timeout_s=120),
    ]
    want = {specs[0].case_id: ERROR, specs[1].case_id: ERROR, specs[2].case_id: SKIP}
    md, runs = compare_executors(specs, tmp_path, jobs=2)
    assert set(runs) == {"old", "new", "served"}
    for path, run in runs.items():
        assert {s.case_id: r.verdict for s, r in run.results} == want, path
        for case_id in (specs[0].case_id, specs[1].case_id):  # the worker's own error, in the case's log
            assert "MPS client found no CUDA device" in (tmp_path / path / "logs" / f"{case_id}.out.log").read_text()
    assert "| new | forkserver | shared | 3 |" in md and "| served | server | shared | 3 |" in md
    assert "Verdict diff: 0 case(s) (the paths agree)" in md and "Verdict diff, old -> served: 0 case(s)" in md
    assert "The served path's server took" in md
    # the diff comes from the verdicts: one case changed on the new path, another on the served one
    runs["new"].results[0][1].verdict = CRASH
    served = next(r for s, r in runs["served"].results if s.case_id == specs[2].case_id)
    served.verdict = CLEAN
    diff = paths_markdown(runs)
    assert f"Verdict diff: 1 case(s):\n- {runs['new'].results[0][0].case_id}: error -> crash\n" in diff
    assert f"Verdict diff, old -> served: 1 case(s):\n- {specs[2].case_id}: skip -> clean\n" in diff


def test_phases_split_a_case_process_for_the_benchmark(server, tmp_path):
    spec = CaseSpec("vllm", "fresh", timeout_s=60)
    res, _ = run_process(spec, [], case_env(), tmp_path, False, server, ("tests.standin_worker:phased", []))
    p = res.phases
    assert res.verdict == CLEAN and set(p) == {"start_s", "import_s", "cuda_init_s", "work_s", "teardown_s"}
    assert p["start_s"] >= 0 and p["teardown_s"] >= 0
    assert abs(sum(p.values()) - res.wall_s) < 0.05  # the phases account for the whole process


def test_a_faulting_case_keeps_its_start_up_phases(tmp_path):
    """A case that crashes prints no result; the device line it printed after CUDA init still splits its time."""
    import json

    from repro.judge.classify import classify
    from repro.run.process import ProcessRun
    from repro.run.runner import with_process_phases

    t0 = 1000.0
    out = (
        'REPRO_DEVICE {"gpu_uuid": "GPU-1", "phases": '
        + json.dumps({"main_at": t0 + 0.1, "import_s": 2.0, "cuda_init_s": 0.2})
        + "}\ntorch.AcceleratorError: CUDA error: an illegal memory access was encountered\n"
    )
    spec = CaseSpec("vllm", "stale", timeout_s=60)
    res = with_process_phases(classify(spec, out, 1, False, None, 3.0), ProcessRun(1, False, False, 3.0, t0))
    assert res.verdict == CRASH and res.gpu_uuid == "GPU-1"
    assert res.phases == {"start_s": 0.1, "import_s": 2.0, "cuda_init_s": 0.2, "rest_s": 0.7}


def test_ctrl_c_in_the_parent_kills_the_case_and_its_children(server, tmp_path):
    import signal

    pidfile = tmp_path / "grandchild.pid"

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 3.0)
    try:
        with pytest.raises(KeyboardInterrupt):
            server.run("tests.standin_worker:hang", [str(pidfile)], case_env(), tmp_path / "c.log", 60)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert gone(int(pidfile.read_text()))  # nothing the case started outlives the interrupted run


# Memcheck processes started ahead of their cases (WarmPool), under a stand-in compute-sanitizer.

STANDIN = ("tests.standin_worker",)


@pytest.fixture
def standin_sanitizer(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "compute-sanitizer"
    script = Path(__file__).with_name("standin_sanitizer.py")
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{script}" "$@"\n')
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return exe


def _memcheck_spec():
    return CaseSpec("vllm", "stale", sanitizer=True, timeout_s=30)


def test_a_warm_process_runs_its_case_with_the_case_environment(standin_sanitizer, tmp_path):
    server = ForkExecutor(case_env(), preload=STANDIN, spares=1)
    spec = _memcheck_spec()
    server.prepare([spec], memcheck_launch_env())
    env = {**memcheck_launch_env(), "CUDA_VISIBLE_DEVICES": "7"}  # applied before CUDA starts: it fits
    try:
        res, out = run_process(
            spec, ["not", "used"], env, tmp_path, True, server, ("tests.standin_worker:clean", ["w"])
        )
    finally:
        server.close()
    assert res.verdict == CLEAN and "stand-in w" in res.reason  # its record came through the channel
    assert "gpu 7" in out and "injected injected" in out  # the case's variable, and the sanitizer's injection kept
    _, memcheck = case_logs(tmp_path, spec.case_id)
    assert memcheck.read_text().startswith(
        "========= COMPUTE-SANITIZER"
    )  # the warm process's log, under the case's name


def test_memcheck_case_stops_once_the_first_error_is_written_whole(standin_sanitizer, tmp_path, fixtures):
    server = ForkExecutor(case_env(), preload=STANDIN, spares=1)
    spec = _memcheck_spec()
    server.prepare([spec], memcheck_launch_env())
    log = fixtures / "memcheck" / "combine-oob-upstream-16sm-nopoison.log"
    try:
        target = ("tests.standin_worker:memcheck_finding", [str(log), "1.5"])
        res, out = run_process(spec, [], memcheck_launch_env(), tmp_path, True, server, target)
    finally:
        server.close()
    assert res.verdict == OOB and res.kernel == "combine"
    assert "wrote all" in out and "stopped 0.5 s after memcheck's first complete finding" in res.reason
    assert 1.5 <= res.wall_s < 1.5 + 5  # not on the half-written error, and not at the 30 s timeout


def test_a_case_whose_environment_does_not_fit_runs_as_a_program_of_its_own(standin_sanitizer, tmp_path):
    server = ForkExecutor(case_env(), preload=STANDIN, spares=1)
    spec = _memcheck_spec()
    server.prepare([spec], memcheck_launch_env())
    env = {**memcheck_launch_env(), "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}  # fixed at import
    cmd = [sys.executable, "-c", "print('a program of its own')"]
    try:
        started = server.warm.started
        res, out = run_process(spec, cmd, env, tmp_path, True, server, ("tests.standin_worker:clean", ["w"]))
        assert server.warm.started == started and "a program of its own" in out
    finally:
        server.close()


def test_pool_starts_no_more_than_its_cases_and_close_leaves_no_process(standin_sanitizer):
    pool = WarmPool(memcheck_launch_env(), spares=2, budget=3, preload=STANDIN)
    env = memcheck_launch_env()
    taken = [pool.take(env) for _ in range(3)]
    pool.top_up()
    assert pool.started == 3 and not pool.spare  # 2 ahead, 1 more once the first was taken, none past the budget
    taken.append(pool.take(env))  # past the budget: started when asked
    assert pool.started == 4
    spare = WarmPool(memcheck_launch_env(), spares=2, budget=5, preload=STANDIN)
    pids = [w.proc.pid for w in spare.spare]
    spare.close()
    pool.close()
    assert pool.take(env) is None
    for w in taken:
        w.proc.stdin.close()  # an empty request: the process ends without a case
        w.proc.wait(timeout=30)
    assert not any(group_alive(p) for p in pids)  # the sanitizer and the process under it are gone


def test_pool_imports_no_more_than_max_importing_at_once(standin_sanitizer):
    pool = WarmPool(memcheck_launch_env(), spares=6, budget=6, preload=STANDIN, max_importing=2)
    try:
        assert pool.started == 2  # two importing: the rest wait
        seen_ready = False
        for _ in range(300):
            pool.top_up()
            seen_ready = seen_ready or any(w.ready for w in pool.spare)
            if pool.started == 6:
                break
            time.sleep(0.05)
        assert pool.started == 6 and seen_ready  # more started as the first finished importing
        assert len([w for w in pool.spare if w.importing()]) <= 2
    finally:
        pool.close()


def test_a_case_whose_import_time_variable_differs_starts_fresh_and_says_why(tmp_path):
    """A variable the forkserver's imports read (the allocator, the FA3 libraries, the Python path) that the case sets
    otherwise: the case is not forked (run() answers None, the runner starts it as its command) and the executor's
    notes name the variable; a variable read only later (the GPU to use) forks as before."""
    ex = forkserver(spares=0)
    try:
        out = tmp_path / "c.out.log"
        env = {**case_env(), "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
        assert ex.run("tests.standin_worker:clean", ["x"], env, out, 60) is None
        assert any("PYTORCH_CUDA_ALLOC_CONF" in n for n in ex.notes)
        late = {**case_env(), "CUDA_VISIBLE_DEVICES": "7", "SOME_SHELL_VAR": "x"}
        run = ex.run("tests.standin_worker:clean", ["x"], late, out, 60)
        assert run is not None and run.returncode == 0
    finally:
        ex.close()
    spec = CaseSpec("vllm", "stale", timeout_s=30)
    env = {**case_env(), "FA3_LIB": "/elsewhere"}
    cmd = [sys.executable, "-c", "import sys; print('fresh'); sys.exit(0)"]
    ex = forkserver(spares=0)
    try:
        res, out_text = run_process(spec, cmd, env, tmp_path, False, ex, ("tests.standin_worker:clean", ["y"]))
    finally:
        ex.close()
    assert "fresh" in out_text and "stand-in" not in out_text  # started as its command, not forked


def test_a_forked_case_s_exit_status_is_the_forkserver_s_report(tmp_path):
    ex = forkserver(spares=0)
    try:
        runs = {
            fn: ex.run(f"tests.standin_worker:{fn}", ["x"], case_env(), tmp_path / f"{fn}.log", 60)
            for fn in ("clean", "crash", "boom")
        }
    finally:
        ex.close()
    assert runs["clean"].returncode == 0 and runs["boom"].returncode == 1 == runs["crash"].returncode
    assert not list(tmp_path.glob("*.exit"))  # no side file: the forkserver reaped the case and said how it ended
