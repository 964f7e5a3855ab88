"""The gate's whole-run timeline from a record (`records --speed NAME --timeline`), the scheduler's order (references
first beside the cases, the cases longest first by measured or modelled cost) and the simulation from a record that
predicts what an order and a number of slots make of a run's wall."""

from __future__ import annotations

import threading
import time

from repro.case.spec import CaseResult
from repro.cli import main
from repro.contract.verdicts import CLEAN
from repro.vllm_integration.gate import order, placement, timeline
from repro.vllm_integration.gate import process as gate_process
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.cache import GateCache
from repro.vllm_integration.gate.modes import parse_modes
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild
from tests.records import RESULTS

H100 = "h100-gate-default-cold"  # every method, inductor, cold, on the code before references ran first


def test_the_timeline_of_a_recorded_run_shows_every_process_its_wait_and_the_chain_that_ended_last():
    tl = timeline.load(RESULTS / H100)
    p = timeline.profile(tl)
    assert p["forkserver_ready"] == 19.8 and p["first_start"] == 19.8 and tl.workers == 8
    # 47 processes with a row, and the three reruns started beside the dflash self control and dropped
    assert p["processes"] == 50 and p["by_kind"]["beside"][0] == 3 and p["by_kind"]["reference"][0] == 5
    assert p["cold_jit"][0] == 9 and p["cold_jit"][1] > 300  # the first wave compiled Triton's kernels, each alone
    assert 170 < p["last_end"] < p["wall"] < 174
    crit = [c for c, _, _ in p["critical_path"]]
    assert crit[-1].endswith("self-control-dflash-plain")  # its two further attempts ran alone, at the end
    refs = [q for q in tl.procs if q.kind == "reference"]
    assert min(q.start for q in refs) > 130  # the references ran last: no self control was judged early
    assert tl.early == {  # the eagle self control's attempts 2 and 3: its first was already wrong
        "stale_metadata-vllm-0.34.0-self-control-plain": True,
        "stale_metadata-vllm-0.34.0-self-control-dflash-plain": False,
    }
    assert p["idle_slot_seconds"] > 100


def test_a_warm_records_kept_reference_is_no_process_of_its_run():
    tl = timeline.load(RESULTS / "h200-readme-gate-15-warm")
    p = timeline.profile(tl)
    assert "reference" not in p["by_kind"] and p["after_last"] >= 0 and p["last_end"] < tl.wall_s
    assert 25 < p["forkserver_ready"] < 35 and p["cold_jit"][0] == 0


def test_records_speed_timeline_prints_the_table_then_each_runs_timeline(capsys):
    assert main(["records", "--speed", H100, "--timeline"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("| record |") and f"## {H100}: the whole run's timeline" in out
    assert "critical path" in out and "| self-control-dflash-plain-attempt3 | attempt |" in out
    assert f"### {H100}: this scheduler on the record's processes (simulated" in out
    assert main(["records", "--speed", "h200-paths-inductor-0.34.0", "--timeline"]) == 0
    assert "no timeline (not one gate run" in capsys.readouterr().out
    assert main(["records", "--index", "--timeline"]) == 2  # nothing to draw it from: refused, not ignored
    assert "--timeline goes with --speed" in capsys.readouterr().err


def test_the_simulation_replays_the_record_and_the_new_order_cuts_its_wall():
    tl = timeline.load(RESULTS / H100)
    jobs, cold_s = order.jobs_from_timeline(tl)
    assert 40 < cold_s < 50  # Triton's warmup, CUDA's start and the compile a cold process adds
    after = timeline.profile(tl)["after_last"]
    replay = order.simulate(order.without_early_stop(jobs), 8, tl.ready_s, after).wall
    assert abs(replay - tl.wall_s) < 5  # the model replays the record's own order and 8 slots within seconds
    # the new default on that H100 (16 cores, 79 of 80 GiB free): 16 processes at once, 8 on cold caches (a plain
    # control's rerun beside it is one of them), 4 GiB a process of 71 GiB (79 less 0.1 of 80), the references on
    # slots of their own, each holding a process slot; a first run on an empty cache has no measured costs: the static
    # model orders it
    fitted = dict(ref_slots=2, cold_workers=8, budget_gib=79 - 0.1 * 80, per_process=True)
    static = order.policy_order(jobs, order.static_job_cost)
    new = order.simulate(static, 16, tl.ready_s, after, **fitted).wall
    assert new == 140.1 and new < replay - 25
    only_order = order.simulate(static, 8, tl.ready_s, after, ref_slots=2).wall  # the order alone, 8 slots as before
    assert new < only_order == 152.9 < replay
    # counting cases, as the simulation did before: the reruns beside the ten plain self controls were free
    as_cases = order.simulate(static, 16, tl.ready_s, after, **{**fitted, "per_process": False}).wall
    assert as_cases == 132.7 < new
    warm, _ = order.jobs_from_timeline(tl, warm_run=True)
    assert all(j.reference is not None for j in warm)  # a warm run keeps its references: no process
    old_warm = order.simulate(order.without_early_stop(warm), 8, tl.ready_s, after, cold=False).wall
    warm_kw = dict(cold=False, budget_gib=fitted["budget_gib"], per_process=True)
    new_warm = order.simulate(order.policy_order(warm), 16, tl.ready_s, after, **warm_kw).wall
    assert new_warm == 67.8 and new_warm < old_warm - 30 == 68.0
    # the 16 process slots bind it, not the GPU memory: 675 process-seconds over 16 slots is 42 s of the run; an H200's
    # memory (125 GiB of budget) changes nothing, and only counting cases (472 case-seconds) made it 57 s
    roomy = order.simulate(order.policy_order(warm), 16, tl.ready_s, after, **{**warm_kw, "budget_gib": 125.0}).wall
    warm_as_cases = order.simulate(order.policy_order(warm), 16, tl.ready_s, after, cold=False).wall
    assert roomy == new_warm and warm_as_cases == 57.0 < 60 < new_warm


def test_the_prediction_fits_the_slots_to_the_machine_the_record_names():
    tl = timeline.load(RESULTS / H100)
    assert (tl.cpus, tl.memory) == (16, (79.0, 80.0))  # its terminal line: 16 cores, 79 of 80 GiB free
    p = order.predict(tl, timeline.profile(tl)["after_last"])
    assert (p["workers"], p["cold_workers"]) == (16, 8)
    assert p["budget_gib"] == 71.0  # run.MemoryBudget.of_free_gpu: 79 free less 0.1 of the 80 GiB total
    # this scheduler starts no launch-blocking rerun beside a self control (GateCase.name_kernel): the record's ten
    # reruns beside its plain self controls are left out of its predictions (140.1, 138.2 and 67.8 s with them)
    assert (p["cold_static"], p["cold_measured"], p["warm"], p["warm_before"]) == (120.0, 118.7, 57.0, 98.0)
    assert abs(p["replay"] - p["recorded"]) < 5


def test_a_plain_controls_rerun_beside_it_takes_two_process_slots_in_the_simulation():
    pair = order.Job("sc-plain", (10.0,), reference="r", processes=2, gib=8.0)
    one = order.Job("c", (10.0,), reference="r")
    # two slots: the control and its rerun fill them, the next case waits; counting cases it ran beside them
    assert order.simulate([pair, one], 2, 0.0, cold=False, per_process=True).wall == 20.0
    assert order.simulate([pair, one], 2, 0.0, cold=False).wall == 10.0
    # on cold caches: 2 cold slots, the pair holds both; the next case starts once the caches are warm (40 s)
    cold_pair, cold_one = (order.Job(j.case, j.attempts, "r", cold_s=30.0, processes=j.processes) for j in (pair, one))
    sim = order.simulate([cold_pair, cold_one], 4, 0.0, cold_workers=2, per_process=True)
    assert sim.starts == {"sc-plain": 0.0, "c": 40.0} and sim.wall == 50.0
    assert order.simulate([cold_pair, cold_one], 4, 0.0, cold_workers=2).wall == 40.0  # as cases: both cold at once
    # a reference on its own slot holds a process slot too: the pair waits for it
    ref = order.Job("r", (10.0,))
    sim = order.simulate([ref, pair], 2, 0.0, ref_slots=1, cold=False, per_process=True)
    assert sim.starts["sc-plain"] == 10.0 and sim.wall == 20.0
    assert order.simulate([ref, pair], 2, 0.0, ref_slots=1, cold=False).wall == 10.0
    # a pair never waits for more slots than there are: alone on one slot, it runs
    assert order.simulate([pair], 1, 0.0, cold=False, per_process=True).wall == 10.0


def test_a_reference_finished_first_stops_a_wrong_self_controls_further_attempts():
    ref = order.Job("r", (5.0,))
    sc = order.Job("sc", (20.0, 10.0, 10.0), reference="r", early_stop=True)
    assert order.simulate([sc, ref], 1, 0.0, cold=False).wall == 45.0  # the reference after it: every attempt
    assert order.simulate([ref, sc], 1, 0.0, cold=False).wall == 25.0
    assert order.simulate([sc, ref], 1, 0.0, ref_slots=1, cold=False).wall == 20.0  # beside it


def test_longest_first_ends_sooner_than_the_plans_order_and_cold_processes_pay_once():
    short = [order.Job(f"s{i}", (10.0,), reference="r") for i in range(4)]
    long = order.Job("long", (40.0,), reference="r")
    assert order.simulate([*short, long], 2, 0.0, cold=False).wall == 60.0
    assert order.simulate(order.policy_order([*short, long]), 2, 0.0, cold=False).wall == 40.0
    cold = [order.Job(f"c{i}", (10.0,), reference="r", cold_s=30.0) for i in range(3)]
    assert order.simulate(cold, 2, 0.0).wall == 50.0  # two start cold (40 s), the third after them warm


def test_the_static_model_puts_a_self_control_that_may_run_again_first_and_references_cheapest():
    assert order.static_cost(False, True, False, 3) > order.static_cost(False, False, True, 3)
    assert order.static_cost(False, False, True, 3) > order.static_cost(False, False, False, 3)
    assert order.static_cost(True, False, False, 3) < order.static_cost(False, False, False, 3)


def _gate(monkeypatch, tmp_path, jobs=2, cold_jobs=None):
    """A gate run of stand-in processes (0.03 s each): the order they started in, how many ran at once while the
    build's caches were cold and after, the run and its cache. The caches turn warm when the first case ends."""
    started, lock, state = [], threading.Lock(), {"warm": False, "now": 0, "cold": 0, "warm_most": 0}

    def stand_in(case, builds, log_dir, mps=None, cache=None, device=None, launcher=None):
        with lock:
            started.append(case.case_id)
            state["now"] += 1
            key = "warm_most" if state["warm"] else "cold"
            state[key] = max(state[key], state["now"])
        time.sleep(0.03)
        with lock:
            state["now"] -= 1
            state["warm"] = state["warm"] or not case.reference
        return CaseResult(case.case_id, CLEAN, ""), None

    monkeypatch.setattr(gate_process, "run_attributed", stand_in)
    monkeypatch.setattr(gate_run, "gpu_identity", lambda: "stand-in GPU 132 SMs")
    monkeypatch.setattr(GateCache, "load_reference", lambda *a: None)
    monkeypatch.setattr(GateCache, "is_warm", lambda self, build, compile: state["warm"])
    build = VllmBuild("0.34.0", str(tmp_path), UNDER_TEST, "0.34.0")
    cache = GateCache(tmp_path / "cache")
    kw = dict(jobs=jobs, launcher="spawn", cache=cache, memory=None, cold_jobs=cold_jobs)
    run = gate_run.run_gate([build], parse_modes("audit,plain"), tmp_path / "logs", **kw)
    return started, run, cache, state


def test_the_scheduler_starts_the_reference_first_and_the_cases_longest_first(monkeypatch, tmp_path):
    started, run, cache, _ = _gate(monkeypatch, tmp_path)
    assert started[0].endswith("-reference-sm-all")  # on its own slot, beside the first cases
    cases = [c for c in started if not c.endswith("-reference-sm-all") and "-attempt" not in c]
    # the build's first case expected clean writes its vLLM cache: first; then by the static model the self controls
    # in plain (further attempts possible), then the audit cases, the plain case under test last
    assert cases[0] == "stale_metadata-vllm-0.34.0-under-test-audit"
    assert all(c.endswith("-plain") and "self-control" in c for c in cases[1:3])
    assert cases[-1].endswith("under-test-plain")
    assert len(run.cases) == 6 and len(run.references) == 1
    costs = cache.load_costs("stand-in GPU 132 SMs")
    assert set(costs) == {c for c in started if "-attempt" not in c}  # measured for the next run, per case
    # a chain's seconds: the stand-in's clean self control in plain ran its three attempts (0.03 s each)
    assert costs["stale_metadata-vllm-0.34.0-self-control-plain"] >= 0.09 > costs[cases[-1]]


def test_the_next_run_orders_its_cases_by_what_the_last_run_measured(monkeypatch, tmp_path):
    cache = GateCache(tmp_path / "cache")
    gpu = "stand-in GPU 132 SMs"
    cache.store_costs(gpu, {"stale_metadata-vllm-0.34.0-under-test-plain": 99.0})
    started, _, cache, _ = _gate(monkeypatch, tmp_path)
    cases = [c for c in started if not c.endswith("-reference-sm-all") and "-attempt" not in c]
    assert cases[1] == "stale_metadata-vllm-0.34.0-under-test-plain"  # measured longest: after the cache's writer
    assert cache.load_costs(gpu)["stale_metadata-vllm-0.34.0-under-test-plain"] < 99.0  # this run's, kept


def test_one_case_at_a_time_runs_the_references_first_in_the_one_queue(monkeypatch, tmp_path):
    started, _, _, _ = _gate(monkeypatch, tmp_path, jobs=1)
    assert started[0].endswith("-reference-sm-all") and len([c for c in started if "-attempt" not in c]) == 7


def test_cases_on_cold_caches_run_cold_jobs_at_once_and_the_rest_join_once_the_caches_are_warm(monkeypatch, tmp_path):
    started, run, _, state = _gate(monkeypatch, tmp_path, jobs=6, cold_jobs=2)
    # 2 cold cases at most and the reference beside them; once warm up to 6 cases and the reference
    assert state["cold"] <= 3 and state["warm_most"] >= 4
    assert len(run.cases) == 6
    _, _, _, state = _gate(monkeypatch, tmp_path / "given", jobs=6)  # `--jobs 6`, not fitted: 6 on cold caches too
    assert state["cold"] >= 4


def test_the_cold_slots_let_a_waiting_case_start_once_its_build_is_warm():
    warm = {"now": False}
    slots = placement.ColdSlots(1, lambda c: warm["now"], poll_s=0.01)
    case = type("C", (), {"reference": False})()
    order = []
    with slots.hold(case):
        t = threading.Thread(target=lambda: slots.hold(case).__enter__() or order.append("second started"))
        t.start()
        time.sleep(0.05)
        assert order == [] and slots.running == 1  # cold, the one slot taken: it waits
        warm["now"] = True
        t.join(1)
        assert order == ["second started"] and slots.running == 1  # warm: started without a slot
    assert slots.running == 0 and slots.worst == 1


def test_the_simulated_memory_budget_holds_a_case_back_until_it_fits():
    big = [order.Job(f"b{i}", (10.0,), reference="r", gib=8.0) for i in range(2)]
    small = order.Job("s", (10.0,), reference="r", gib=4.0)
    assert order.simulate([*big, small], 3, 0.0, cold=False, budget_gib=12.0).wall == 20.0  # b1 waits for b0
    assert order.simulate([*big, small], 3, 0.0, cold=False, budget_gib=20.0).wall == 10.0
    assert order.simulate([*big, small], 3, 0.0, cold=False).wall == 10.0  # no budget: the slots alone


def test_a_fitted_gate_limits_cold_caches_to_half_the_cores_and_a_given_jobs_does_not(monkeypatch, tmp_path):
    from repro.errors import ConfigError
    from repro.run import memory
    from tests.commands import fake_vllm

    seen = []

    def stand_in(*a, **k):
        seen.append((a[4], k.get("cold_jobs")))  # jobs, cold_jobs
        raise ConfigError("stand-in: the run itself is not this test's")

    monkeypatch.setattr(gate_run, "run_gate", stand_in)
    monkeypatch.setattr(placement, "cpu_cores", lambda: 16)
    monkeypatch.setattr(memory, "gpu_memory_gib", lambda: [(80.0, 79.0)])
    build = fake_vllm(tmp_path / "build", compiled=False)
    args = ["gate", "--no-installed", "--vllm", f"a={build}", "--cache-dir", str(tmp_path / "cache")]
    assert main([*args, "--out", str(tmp_path / "fitted")]) == 2
    assert main([*args, "--out", str(tmp_path / "given"), "--jobs", "3"]) == 2
    assert seen == [(16, 8), (3, None)]  # fitted: 16 at once, 8 on cold caches; --jobs 3: 3 everywhere


def test_a_record_without_self_control_reruns_simulates_one_process_per_plain_control():
    """A run that started no rerun beside its plain self controls (GateCase.name_kernel, h100-gate-default-3-warm):
    its own order is simulated with one process each, and the model replays it within a second; the earlier record's
    controls held two."""
    tl = timeline.load(RESULTS / "h100-gate-default-3-warm")
    jobs, _ = order.jobs_from_timeline(tl)
    assert {j.processes for j in jobs} == {1} and any(
        "self-control" in j.case and j.case.endswith("-plain") for j in jobs
    )
    replay = order.simulate(order.without_early_stop(jobs), tl.workers, tl.ready_s, 0.0).wall
    assert abs(replay - tl.wall_s) < 1.5
    before, _ = order.jobs_from_timeline(timeline.load(RESULTS / "h100-gate-default-2-warm"))
    assert sum(j.processes == 2 for j in before) == 10  # each plain self control, both forms, five methods
