"""The vLLM gate end to end on CPU, over stand-in vLLM builds (tests/fake_vllm.py): build discovery, the case
process, the plugin loaded through its real entry point, classification, the launch-blocking attribution, the
reference comparison, the gate's exit codes and report. Plus the pieces on their own: modes, token comparison."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch

from repro.case.poison import parse_poison
from repro.case.spec import CaseResult
from repro.cli import main as cli
from repro.contract import request
from repro.contract.verdicts import CANNOT_VOUCH, CLEAN, CRASH, ERROR, STALE_AUDIT, WRONG
from repro.errors import ConfigError
from repro.judge.classify import classify
from repro.judge.decision import MODE_WITHOUT_POSITIVE, NO_POSITIVE, Failure
from repro.vllm_integration import plugin
from repro.vllm_integration.gate.case import GateCase, plan
from repro.vllm_integration.gate.judge import apply_reference, compare_tokens, not_fired
from repro.vllm_integration.gate.modes import GateMode, parse_modes
from repro.vllm_integration.gate.process import run_case
from repro.vllm_integration.gate.run import run_gate
from repro.vllm_integration.gate.steps import annotate
from repro.vllm_integration.plugin import fa3_hooks, weights
from repro.vllm_integration.releases.builds import (
    CONTROL,
    UNDER_TEST,
    VllmBuild,
    build_pythonpath,
    find_builds,
    parse_builds,
)
from tests.case_requests import case_request, plugin_request
from tests.fake_vllm import write_fake_vllm

needs_entry_point = pytest.mark.skipif(
    not any(e.value.startswith("repro.") for e in importlib.metadata.entry_points(group="vllm.general_plugins")),
    reason="the repro plugin's entry point is not installed (pip install -e .)",
)


@pytest.fixture
def fakes(tmp_path):
    return {
        b: str(write_fake_vllm(tmp_path / b, v, b))
        for b, v in (("good", "0.26.0"), ("stale-crash", "0.25.1"), ("stale-quiet", "0.25.1"), ("wrong", "0.26.0"))
    }


def gate_args(out, modes: str, *more: str) -> list[str]:
    """`gate` over the builds named after it (none installed) in MODES, EAGLE only, two jobs, its report in OUT."""
    return ["gate", "--no-installed", "--modes", modes, "--methods", "eagle", "--jobs", "2", "--out", str(out), *more]


def _verdicts(run):
    return {c.case_id.split("-vllm-")[1]: r for c, r in run.cases}


def test_modes_parse_and_refuse():
    modes = parse_modes("audit,plain,mps:16,sm_margin:16,poison:int-max,memcheck,memcheck:async")
    assert [m.label for m in modes] == [
        "audit", "plain", "mps16", "smmargin16", "poison-int-max", "memcheck", "memcheck-async"
    ]  # fmt: skip
    assert modes[0].audit and modes[3].sm.sms == 16 and not modes[5].gating and modes[1].gating
    for bad in ("bogus", "mps:x", "poison:none", "memcheck:fast", ""):
        with pytest.raises(ConfigError):
            parse_modes(bad)


def test_a_mode_that_hooks_fa3_is_refused_beside_another_backend_alone_or_inside_another_mode():
    """sm_margin and poison hook FA3's own calls (GateMode.hooks_fa3, from the parsed mode, never its name): with
    another attention backend plan refuses them, inside audit+ or memcheck:own+ as well as alone."""
    build = VllmBuild("0.26.0", None, UNDER_TEST, "0.26.0")
    for name in ("sm_margin:16", "poison:int-max", "audit+sm_margin:16", "memcheck:own+poison:int-max"):
        (mode,) = parse_modes(name)
        assert mode.hooks_fa3, name
        with pytest.raises(ConfigError, match="hooks FA3's calls"):
            plan([build], (mode,), 1, 60.0, backends=("FLASH_ATTN", "TRITON_ATTN"))
    others = parse_modes("audit,plain,mps:16,audit+mps:16,memcheck")
    assert not any(m.hooks_fa3 for m in others)
    assert len(plan([build], others, 1, 60.0, backends=("TRITON_ATTN",), self_control="none")) == len(others)


def test_the_auditor_runs_in_an_sm_configuration_and_the_sweep_preset_lists_every_one():
    """audit+sm_margin:N / audit+mps:N: the auditor with that restriction (its case shares the SM configuration's
    reference); `hidden-sweep`: audit and plain on the full GPU and at 8/16/24/40/66 SMs of both restrictions."""
    (m,) = parse_modes("audit+mps:24")
    assert m.audit and m.sm.kind == "mps" and m.sm.sms == 24 and m.label == "audit-mps24" and m.gating
    sweep = parse_modes("hidden-sweep")
    assert len(sweep) == 22 and sum(x.audit for x in sweep) == 11
    assert {(x.sm.kind, x.sm.sms) for x in sweep} == {("full", None)} | {
        (k, n) for k in ("sm_margin", "mps") for n in (8, 16, 24, 40, 66)
    }
    for bad in ("audit+plain", "audit+audit", "audit+poison:int-max", "audit+memcheck", "hidden-sweep,plain"):
        with pytest.raises(ConfigError):
            parse_modes(bad)


def test_builds_from_the_environment(tmp_path, fakes):
    env = {"REPRO_VLLM": f"new={fakes['good']}", "REPRO_VLLM_CONTROL": f"old={fakes['stale-crash']}"}
    builds = find_builds(env, include_installed=False)
    assert [(b.label, b.role, b.version) for b in builds] == [("new", UNDER_TEST, "0.26.0"), ("old", CONTROL, "0.25.1")]
    path = build_pythonpath(builds[0], builds, f"{fakes['stale-crash']}:/elsewhere")
    assert path.split(":") == [fakes["good"], "/elsewhere"]  # never two vLLMs on one path
    for bad in ("nolabel", f"a b={fakes['good']}", f"x={tmp_path}"):
        with pytest.raises(ConfigError):
            parse_builds(bad, UNDER_TEST, "REPRO_VLLM")


def test_token_comparison_stops_at_ties_and_flags_decided_differences():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8]]
    margins = [[1.0, 1.0, 0.01, 1.0], [1.0, 1.0, 1.0, 1.0]]
    ok = compare_tokens([[1, 2, 9, 9], [5, 6, 7, 8]], ref, margins)
    assert (ok.compared, ok.ties, ok.wrong) == (6, 1, [])  # a difference at a near tie stops that request
    bad = compare_tokens([[1, 2, 3, 4], [5, 6, 0, 8]], ref, margins)
    assert bad.wrong and bad.worst_margin == 1.0 and "request 1 token 2" in bad.wrong[0]
    first = CaseResult("c", CLEAN, "")
    res = apply_reference(first, {"tokens": [[1, 2, 9, 9], [5, 0, 0, 0]]}, CaseResult("r", CLEAN, ""), {"tokens": ref})
    assert res.verdict == WRONG and first.verdict == CLEAN  # a new record; the first one stays as classify made it
    assert res.history[-1]["step"] == "reference comparison" and res.history[-1]["changed"]["verdict"] == [CLEAN, WRONG]
    res = apply_reference(first, {"tokens": ref}, CaseResult("r", CRASH, "boom"), None)
    assert res.verdict == ERROR and "no reference" in res.reason  # never clean without a reference


@needs_entry_point
def test_gate_end_to_end_on_stand_in_builds(tmp_path, fakes):
    builds = parse_builds(f"good={fakes['good']},wrong={fakes['wrong']}", UNDER_TEST, "REPRO_VLLM")
    builds += parse_builds(f"crash={fakes['stale-crash']},quiet={fakes['stale-quiet']}", CONTROL, "REPRO_VLLM_CONTROL")
    # forked case processes: the spawned ones' records (test_vllm_gate_fork); spawned end to end: compile_none below
    run = run_gate(builds, parse_modes("audit,plain"), tmp_path / "logs", jobs=4, timeout_s=120, launcher="fork")
    v = _verdicts(run)
    assert v["good-under-test-audit"].verdict == CLEAN, v["good-under-test-audit"].reason
    assert "audit: 0 stale fields in 13 checks" in v["good-under-test-audit"].evidence
    ident = v["good-under-test-audit"].backend_identity
    kinds = ("target decode", "draft prefill", "draft decode")
    assert {k: ident["counters"]["captures_audited"][k] for k in kinds} == dict.fromkeys(kinds, 2)
    assert ident["engine"]["model_runner_v2"] and ident["engine"]["cudagraph_mode"] == "FULL_AND_PIECEWISE"
    assert ident["acceptance"]["spec_decode_num_accepted_tokens"] == 30
    assert all(r.expected == ("clean" if "under-test" in c.case_id else r.expected) for c, r in run.cases)
    assert "tokens: 64 of 64 compared equal" in v["good-under-test-plain"].evidence
    assert v["wrong-under-test-plain"].verdict == WRONG and v["wrong-under-test-plain"].max_abs_err == 2.4
    crash = v["crash-control-plain"]
    assert crash.verdict == CRASH and crash.kernel == "combine" and "CUDA_LAUNCH_BLOCKING" in crash.evidence
    assert v["crash-control-audit"].verdict == CRASH and v["crash-control-audit"].stale_fields
    quiet = v["quiet-control-audit"]
    assert quiet.verdict == STALE_AUDIT and quiet.descriptor == "t32r8" and "query_start_loc" in quiet.reason
    assert v["quiet-control-plain"].verdict == CLEAN
    assert {c.case_id.rsplit("-", 1)[1] for c, _ in run.affected() if "-wrong-" in c.case_id} == {"audit", "plain"}
    assert len(run.affected()) == 2
    # a control that came back clean in plain, caught by its audit: policy rule 5's listed miss, not HARNESS BLIND
    assert not run.blind() and [m.split("-vllm-")[1] for m in run.decision().misses] == [
        "quiet-control-plain: clean (detected in audit)"
    ]
    # a known-bad build expects `known-bad` in every mode, the audit too (judged over its modes and methods: rule 5)
    assert v["quiet-control-audit"].expected == v["crash-control-plain"].expected == "known-bad"
    assert all(r.vllm_version in ("0.25.1", "0.26.0") for _, r in run.cases)


def test_compile_none_runs_full_graphs_without_torch_compile_in_every_speculative_case(tmp_path, fakes):
    """--compile none: the speculative cases ask vLLM for compilation mode 0 and FULL graphs, say so in their ids and
    in the engine they report; references (never compiled) keep theirs, shared with the default."""
    builds = parse_builds(f"good={fakes['good']}", UNDER_TEST, "REPRO_VLLM")
    builds += parse_builds(f"crash={fakes['stale-crash']}", CONTROL, "REPRO_VLLM_CONTROL")
    run = run_gate(builds, parse_modes("audit"), tmp_path / "logs", jobs=4, timeout_s=120, compile="none")
    v = _verdicts(run)
    assert set(v) == {"good-under-test-compile-none-audit", "good-self-control-compile-none-audit",
                      "good-self-control-stale-descriptor-compile-none-audit",
                      "crash-control-compile-none-audit"}  # fmt: skip
    engine = v["good-under-test-compile-none-audit"].backend_identity["engine"]
    assert (engine["compilation_mode"], engine["cudagraph_mode"]) == ("NONE", "FULL")
    assert v["good-under-test-compile-none-audit"].verdict == CLEAN
    assert v["crash-control-compile-none-audit"].verdict == CRASH
    refs = [c for c, _ in run.references]
    assert refs and all(c.compile == "inductor" and "compile" not in c.case_id for c in refs)
    with pytest.raises(ConfigError, match="--compile 'fast'"):
        run_gate(builds, parse_modes("audit"), tmp_path / "logs2", compile="fast")


@pytest.mark.slow  # seven gate runs (conftest: started first)
@needs_entry_point
def test_gate_command_exit_codes_and_report(tmp_path, fakes, capsys):
    out = tmp_path / "out"  # one folder for every run below: --overwrite replaces the report before (docs/outputs.md)
    args = gate_args(out, "plain", "--overwrite")
    # forked case processes: the spawned launcher's verdicts (test_vllm_gate_fork), torch imported once per build and
    # run instead of once per case; the default launcher's CLI runs: test_the_report_of_a_build_that_gave_no_answer...
    args += ["--launcher", "fork"]
    assert cli([*args, "--vllm", f"0.26.0={fakes['good']}", "--control", f"0.25.1={fakes['stale-crash']}"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["kind"] == "vllm-gate" and doc["passed"]
    affected = {b["build"]: b["affected"] for b in doc["builds"]}
    assert affected == {
        "0.26.0": False, "0.25.1": True, "0.26.0 (self control)": True, "0.26.0 (self control, stale-descriptor)": True
    }  # fmt: skip
    md = (out / "verdicts.md").read_text()
    assert "**Gate: PASS**" in md and "draft prefill 2/2/0/0" in md  # captures per kind: total/attention/audited/stale
    cov = {b["build"]: b["coverage"] for b in doc["builds"]}["0.26.0"]
    assert cov["config"]["model_runner_v2"] == [True] and cov["config"]["fa_version"] == ["3"]
    assert cov["captures_with_attention"] == {"target decode": 2, "draft prefill": 2, "draft decode": 2}
    case = next(c for c in doc["cases"] if c["case"].endswith("0.26.0-under-test-plain"))
    assert case["engine"]["speculative_method"] == "eagle" and case["counters"]["attention_forwards"] > 0
    # no known-bad build: the build's own self control is the positive control (the re-created defect caught)
    assert cli([*args, "--vllm", f"0.26.0={fakes['good']}"]) == 0
    decision = json.loads((out / "results.json").read_text())["decision"]
    assert any("mode plain: 2 of 2" in x and "self-control: 2 of 2" in x for x in decision), decision
    assert cli([*args, "--vllm", f"0.26.0={fakes['good']}", "--self-control", "none"]) == 3  # no control: BLIND
    assert cli([*args, "--vllm", f"0.26.0={fakes['good']}", "--no-control"]) == 0  # a bisect step's answer
    assert json.loads((out / "results.json").read_text())["passed"]  # the report agrees with the exit code
    assert cli([*args, "--vllm", f"x={fakes['stale-crash']}", "--no-control"]) == 1  # affected
    broken = str(write_fake_vllm(tmp_path / "broken", "0.27.0", "broken"))
    assert cli([*args, "--vllm", f"y={broken}", "--control", f"0.25.1={fakes['stale-crash']}"]) == 4  # cannot vouch
    assert json.loads((out / "results.json").read_text())["outcome"] == "CANNOT VOUCH"
    assert cli([*args, "--modes", "nope", "--vllm", f"0.26.0={fakes['good']}"]) == 2
    assert "unknown gate mode" in capsys.readouterr().err


def test_plugin_features_from_the_environment():
    assert plugin.requested(plugin.from_environment({}))["audit"] is False
    env = {request.ENV: case_request(plugin_request(audit=True, sm_margin=116, poison="int-max")).to_json()}
    want = plugin.requested(plugin.from_environment(env))
    assert want["audit"] and want["sm_margin"] == 116 and want["poison"].value == 2**31 - 1
    for bad in ({"sm_margin": "x"}, {"sm_margin": -1}, {"poison": "nope"}, {"weights": "?"}):
        with pytest.raises((ValueError, ConfigError)):
            plugin.requested(plugin_request(**bad))


def test_fa3_hooks_pass_sm_margin_and_poison_the_never_written_entries():
    """Against a stand-in op namespace with vLLM's fwd schema position for sm_margin."""
    seen = {}

    def sched(**kw):
        seen["sched"] = kw
        return torch.zeros(1 + 4 * 2, dtype=torch.int32) + 5  # vLLM fork, b=3: prepare_seqlen_q | nheads_in_l2 | sem

    def fwd(*args):
        seen["fwd"] = args
        return args

    arg = types.SimpleNamespace
    fwd.default = arg(_schema=arg(arguments=[arg(name=n) for n in ("q", "k", "sm_margin", "s_aux")]))
    ops, module = types.SimpleNamespace(fwd=fwd), types.SimpleNamespace(__name__="fa", get_scheduler_metadata=sched)
    done = fa3_hooks.install_fa3_hooks(module, ops, sm_margin=116, poison=parse_poison("int-max"))
    assert len(done) == 2
    md = module.get_scheduler_metadata(
        batch_size=3, max_seqlen_q=4, max_seqlen_k=100, headdim=128, causal=True, page_size=16, window_size=None
    )
    assert seen["sched"]["sm_margin"] == 116
    assert md.tolist() == [5, 5, 5, 2**31 - 1, 5, 5, 5, 2**31 - 1, 5]  # entry b=3 of each vector, semaphore kept
    ops.fwd("q", "k", 0, None)
    assert seen["fwd"] == ("q", "k", 116, None)


def test_margin_weights_are_per_name_and_repeatable():
    m1, m2 = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)), torch.nn.Linear(64, 64)
    assert weights.margin_weights(m1) == 4
    w0, w1 = m1[0].weight.detach().clone(), m1[1].weight.detach().clone()
    assert not torch.equal(w0, w1) and torch.all(m1[0].bias == 1.0)  # vLLM's dummy weights: equal for equal sizes
    assert 0.08 < float(w0.std()) < 0.17  # N(0, 1/fan_in)
    weights.margin_weights(m1)
    assert torch.equal(m1[0].weight, w0)  # same name, same seed
    weights.margin_weights(m2)
    assert not torch.equal(m2.weight, w0)


def test_gate_case_ids_name_build_role_mode():
    b = parse_builds.__globals__["VllmBuild"]("0.25.1", None, CONTROL, "0.25.1")
    c = GateCase(b, GateMode.parse("mps:16"), rep=2)
    assert c.case_id == "stale_metadata-vllm-0.25.1-control-mps16-rep2"
    assert json.loads(c.to_json())["mode"]["sm"] == {"kind": "mps", "sms": 16, "mig_uuid": None}


def _source_tree(tmp_path, rel: str, text: str):
    """A tree holding one vLLM source file at rel (a bisect patch's input)."""
    tree = tmp_path / "tree"
    (tree / rel).parent.mkdir(parents=True)
    (tree / rel).write_text(text)
    return tree


def test_fresh_prefill_capture_rewrites_the_two_spots_once(tmp_path):
    from repro.vllm_integration.releases.bisect import SPECULATOR, fresh_prefill_capture, main

    tree = _source_tree(
        tmp_path,
        SPECULATOR,
        "class S:\n    def init(self):\n        self.prefill_cudagraph_manager = PrefillSpeculatorCudaGraphManager(\n"
        "            cfg)\n\n    def capture(self, attn_states):\n        self.prefill_cudagraph_manager.capture(\n"
        "            self._prefill,\n            attn_states,\n            progress_bar_desc='p',\n        )\n",
    )
    (tree / "vllm" / "ext.so").write_text("binary")
    out = fresh_prefill_capture(tree, tmp_path / "fixed")
    text = (out / SPECULATOR).read_text()
    assert "DecodeSpeculatorCudaGraphManager(" in text and "attn_states," not in text
    assert "self._prefill, self.model_state, self.input_buffers" in text and not (out / "vllm" / "ext.so").exists()
    compile(text, "speculator.py", "exec")
    assert main(["fresh-prefill-capture", str(out), str(tmp_path / "again")]) == 2  # already fixed: no match


def test_stale_draft_capture_puts_the_defect_back_into_the_0_33_capture(tmp_path):
    """The source mutant of a current release: the draft capture's forward gets the metadata built for the first
    descriptor of its (mode, pass), the 0.21-0.25.1 defect (an excerpt of 0.33.0's create_forward_fn)."""
    from repro.vllm_integration.releases.bisect import DRAFT_CAPTURE, main, patched_copy

    tree = _source_tree(
        tmp_path,
        DRAFT_CAPTURE,
        "class M:\n    def capture(self):\n        def create_forward_fn(desc, warmup):\n"
        "            attn_metadata, slot_mappings = prepare_inputs_to_capture(desc.num_tokens)\n\n"
        "            forward_kwargs = {}\n            return attn_metadata, forward_kwargs\n"
        "        return create_forward_fn\n",
    )
    (tree / "vllm-0.33.0.dist-info").mkdir()
    (tree / "vllm-0.33.0.dist-info" / "METADATA").write_text("Version: 0.33.0\n")
    out = patched_copy("stale-draft-capture", tree, tmp_path / "mutant")
    ns: dict = {}
    exec(compile((out / DRAFT_CAPTURE).read_text(), "cudagraph_utils.py", "exec"), ns)
    made = iter(["meta-for-512", "meta-for-8", "meta-for-8-warm"])
    ns["prepare_inputs_to_capture"] = lambda n: (next(made), None)
    fn = ns["M"]().capture()
    desc = lambda n: type("D", (), {"num_tokens": n, "cg_mode": "FULL"})()  # noqa: E731
    assert fn(desc(512), False)[0] == "meta-for-512"
    assert fn(desc(8), False)[0] == "meta-for-512"  # another descriptor's metadata: the defect
    assert fn(desc(8), True)[0] == "meta-for-8-warm"  # the warmup pass keeps its own first build
    assert (out / "vllm-0.33.0.dist-info" / "METADATA").exists()
    assert main(["stale-draft-capture", str(tmp_path / "nothing"), str(tmp_path / "x")]) == 2


HOOK_NOTHING = {  # stand-in behaviour -> what the cannot-vouch reason must name
    "no-forward": "no attention forward went through the hooked FLASH_ATTN impl",
    "other-backend": "no attention forward went through the hooked FLASH_ATTN impl",
    "fa2": "FlashAttention version 2, not FA3",
    "no-spec": "no speculative decoding",
    "piecewise": "cudagraph mode PIECEWISE: no FULL CUDA graphs",
    "v1-runner": "not the V2 model runner",
}


# under xdist, every test reading it runs on one worker (conftest's SHARED_FIXTURE): it runs once
@pytest.fixture(scope="module")
def hook_nothing_gate(tmp_path_factory):
    """One `python -m repro gate` subprocess over every stand-in of HOOK_NOTHING, each a build under test of its own
    (labelled by its behaviour, with its self control and reference): its exit code and results.json. One process
    and one GPU probe for the six builds instead of six."""
    root = tmp_path_factory.mktemp("hook-nothing")
    out = root / "out"
    # forked case processes (--launcher fork): the verdicts and reasons the spawned ones give (test_vllm_gate_fork
    # compares the two launchers on every stand-in behaviour), for a third of the CPU: 78 case processes, each a fresh
    # interpreter importing torch when spawned
    cmd = [sys.executable, "-m", "repro", *gate_args(out, "audit,plain", "--no-control")]
    cmd += ["--launcher", "fork"]
    # one attempt of each self control: three of the six (no-spec, other-backend, piecewise) decode without a fault
    # in plain whatever the injection, and a second and third attempt (12 case processes) would only repeat that
    cmd += ["--self-control-attempts", "1"]
    for behaviour in sorted(HOOK_NOTHING):
        cmd += ["--vllm", f"{behaviour}={write_fake_vllm(root / behaviour, '0.26.0', behaviour)}"]
    # a module fixture runs before conftest's per-test private cache: it names its own, never the user's
    env = {**os.environ, "REPRO_CACHE_DIR": str(root / "repro-cache")}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    return p, out


@needs_entry_point
@pytest.mark.parametrize("behaviour", sorted(HOOK_NOTHING))
def test_builds_that_hook_nothing_cannot_be_vouched_for_through_the_cli(hook_nothing_gate, behaviour):
    """`python -m repro gate` as a subprocess: a stand-in whose checked features never fire is CANNOT VOUCH, exit 4,
    never PASS; the report names what did not fire."""
    p, out = hook_nothing_gate
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    mine = [c for c in doc["cases"] if c["kind"] == "case" and c["build"] == behaviour]
    assert doc["outcome"] == "CANNOT VOUCH" and len([c for c in mine if c["case"] in doc["cannot_vouch"]]) >= 2
    assert {c["case"].rsplit("-", 1)[1] for c in mine} == {"audit", "plain"}
    for c in mine:  # no case of this build is PASS, whatever the other builds did
        if "self-control" not in c["case"]:
            assert c["verdict"] == CANNOT_VOUCH and HOOK_NOTHING[behaviour] in c["reason"], c["reason"]
    if behaviour in ("no-forward", "other-backend"):
        audit = next(c for c in mine if c["case"].endswith("-audit"))
        assert "the freshness auditor made 0 checks" in audit["reason"]
    assert "CANNOT VOUCH" in (out / "verdicts.md").read_text()
    assert not [c["case"] for c in doc["cases"] if "-attempt" in c["case"]]  # --self-control-attempts 1


def test_the_gate_command_attempts_a_self_control_as_often_as_the_gate_does_unless_told():
    from repro.cli import build_parser
    from repro.vllm_integration.gate.process import SELF_CONTROL_ATTEMPTS

    assert build_parser().parse_args(["gate"]).self_control_attempts == SELF_CONTROL_ATTEMPTS
    assert build_parser().parse_args(["gate", "--self-control-attempts", "1"]).self_control_attempts == 1
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gate", "--self-control-attempts", "0"])


@needs_entry_point
def test_renamed_backend_classes_and_no_scheduler_call_through_the_cli(tmp_path):
    """Renamed classes: the hooks cannot go in, every case is an error naming them; no get_scheduler_metadata call:
    the poison mode poisoned nothing. Exit 4 with a control that is caught (one `python -m repro gate` subprocess for
    both builds, each in both modes)."""
    renamed = write_fake_vllm(tmp_path / "renamed", "0.26.0", "renamed")
    nosched = write_fake_vllm(tmp_path / "nosched", "0.26.0", "no-sched")
    crash = write_fake_vllm(tmp_path / "crash", "0.25.1", "stale-crash")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "repro", *gate_args(out, "audit,poison:int-max", "--control", f"old={crash}")]
    cmd += ["--launcher", "fork"]  # the spawned launcher's verdicts (test_vllm_gate_fork), torch imported per build
    cmd += ["--vllm", f"renamed={renamed}", "--vllm", f"nosched={nosched}"]
    p = subprocess.run(cmd, capture_output=True, text=True)
    assert p.returncode == 4, p.stdout[-2000:] + p.stderr[-2000:]
    doc = json.loads((out / "results.json").read_text())
    assert doc["outcome"] == "CANNOT VOUCH"
    # the command's time beside the run's (the setup before run_gate: CLI, builds, GPU probes), for records --speed
    assert 0 < doc["setup_s"] < doc["command_s"] and doc["wall_s"] < doc["command_s"]
    cases = [c for c in doc["cases"] if c["kind"] == "case" and "self-control" not in c["case"]]
    mine = {(c["build"], c["case"].rsplit("-", 1)[1]): c for c in cases}
    for build, mode, verdict, why in (
        ("renamed", "audit", ERROR, "FlashAttentionImpl"),
        ("renamed", "max", ERROR, "FlashAttentionImpl"),  # poison:int-max: the case id ends in -poison-int-max
        ("nosched", "max", CANNOT_VOUCH, "0 scheduler-metadata entries poisoned (0 get_scheduler_metadata"),
    ):
        c = mine[(build, mode)]
        assert c["verdict"] == verdict and why in c["reason"], c
    assert mine[("old", "audit")]["verdict"] == CRASH  # the control caught


@needs_entry_point
def test_a_control_that_hooks_nothing_is_cannot_vouch_not_blind(tmp_path, fakes):
    nospec = str(write_fake_vllm(tmp_path / "nospec", "0.25.1", "no-spec"))
    args = gate_args(tmp_path / "out", "plain")
    args += ["--launcher", "fork"]  # the spawned launcher's verdicts (test_vllm_gate_fork), torch imported per build
    assert cli([*args, "--vllm", f"new={fakes['good']}", "--control", f"old={nospec}"]) == 4
    doc = json.loads((tmp_path / "out" / "results.json").read_text())
    assert doc["outcome"] == "CANNOT VOUCH" and doc["cannot_vouch"] == ["stale_metadata-vllm-old-control-plain"]


@needs_entry_point
def test_sm_margin_counts_the_calls_that_received_it(tmp_path, fakes):
    """sm_margin needs a GPU's SM count: given here. A healthy stand-in counts every scheduler and FA3 call; one whose
    builder never calls get_scheduler_metadata cannot be vouched for."""
    nosched = str(write_fake_vllm(tmp_path / "nosched", "0.26.0", "no-sched"))
    mode = GateMode.parse("sm_margin:16")
    for prefix, fired in ((fakes["good"], True), (nosched, False)):
        (build,) = parse_builds(f"x={prefix}", UNDER_TEST, "REPRO_VLLM")
        case = GateCase(build, mode, timeout_s=120)
        res = run_case(case, [build], tmp_path / "logs" / str(fired), total_sms=lambda: 132)
        assert res.verdict == CLEAN, res.reason
        c = res.backend_identity["counters"]
        missing = not_fired(case, res.backend_identity)
        if fired:
            assert c["sched_sm_margin"] == c["sched_calls"] > 0 and c["fwd_sm_margin"] > 0 and not missing
        else:
            assert c["sched_sm_margin"] == 0 and any("get_scheduler_metadata" in m for m in missing)


def test_an_install_error_under_the_audit_tag_is_an_error_verdict(tmp_path):
    """Any hook's install error reaches the verdict, whichever of the plugin's tags printed it."""
    (build,) = parse_builds(f"x={write_fake_vllm(tmp_path / 'v', '0.26.0', 'good')}", UNDER_TEST, "REPRO_VLLM")
    case = GateCase(build, GateMode.parse("audit"))
    out = "\n".join(
        [
            'REPRO_PLUGIN {"installed": "probe"}',
            'REPRO_PLUGIN {"installed": "audit"}',
            'REPRO_PLUGIN {"installed": "weights"}',
            'REPRO_AUDIT {"error": "flash_attn: FlashAttentionMetadataBuilder/FlashAttentionImpl not found"}',
            'REPRO_RESULT {"tokens": [[1]], "summary": "1 request"}',
        ]
    )
    res = classify(case, out, 0, False, None, 1.0)
    assert res.verdict == CLEAN
    res = annotate(res, case, out, None)
    assert res.verdict == ERROR and "not found" in res.reason and res.history[-1]["step"] == "plugin"


def test_the_kernel_comes_from_the_faulting_line_only(tmp_path):
    (build,) = parse_builds(f"x={write_fake_vllm(tmp_path / 'v', '0.25.1', 'good')}", CONTROL, "REPRO_VLLM")
    case = GateCase(build, GateMode.parse("plain"), launch_blocking=True)
    out = "loading flash_fwd_combine_launch_template.h\nCUDA error (flash_fwd_launch_template.h:9): an illegal memory access"
    res = annotate(classify(case, out, 1, False, None, 1.0), case, out, None)
    assert res.kernel == "main"  # not "combine", which an unrelated line names


def test_the_gate_outcome_reads_failure_kinds_not_their_words(monkeypatch):
    """Rewording a policy message must not change an outcome: GateRun decides by Failure.kind and case id."""
    from repro.judge import policy
    from repro.vllm_integration.gate.outcome import GateRun

    build = VllmBuild("0.26.0", None, UNDER_TEST, "0.26.0")
    case = GateCase(build, GateMode.parse("plain"))
    run = GateRun(cases=[(case, CaseResult(case.case_id, CLEAN, "", expected="clean"))])
    assert run.outcome() == "HARNESS BLIND" and run.outcome(need_control=False) == "PASS"
    kinds = {f.kind for f in run.decision().failures}
    assert kinds == {MODE_WITHOUT_POSITIVE, NO_POSITIVE}
    original = policy.decide

    def reworded(controls, required=frozenset()):
        d = original(controls, required)
        d.failures = [Failure("something else entirely", f.kind, f.case_id) for f in d.failures]
        return d

    monkeypatch.setattr(policy, "decide", reworded)
    assert run.outcome() == "HARNESS BLIND" and run.outcome(need_control=False) == "PASS"
    injected = replace(case, inject="stale-capture")
    run.cases.append((injected, CaseResult(injected.case_id, CLEAN, "", expected="detected")))
    assert run.outcome(need_control=False) == "HARNESS BLIND"  # a self control that missed is never a pass
    assert run.blind(need_control=False)[0].startswith("something else entirely")


def test_the_outcome_of_an_affected_build_and_of_one_that_gave_no_answer():
    """AFFECTED when a build under test showed the bug, CANNOT VOUCH when it gave no answer (an error), whatever the
    controls; a build under test's own failure is never the harness's blindness."""
    from repro.vllm_integration.gate.outcome import GateRun

    case = GateCase(VllmBuild("0.26.0", None, UNDER_TEST, "0.26.0"), GateMode.parse("plain"))
    crashed = GateRun(cases=[(case, CaseResult(case.case_id, CRASH, "fault", expected="clean"))])
    assert crashed.outcome() == crashed.outcome(need_control=False) == "AFFECTED"
    assert crashed.blind(need_control=False) == []  # its failure is the build's answer, not the harness's
    errored = GateRun(cases=[(case, CaseResult(case.case_id, ERROR, "no answer", expected="clean"))])
    assert errored.outcome() == errored.outcome(need_control=False) == "CANNOT VOUCH"
    assert errored.judge(need_control=False).outcome == "CANNOT VOUCH" and errored.judged() is errored.judgment


def test_compare_paths_reports_the_outcome_its_exit_code_reads(tmp_path):
    """--compare-paths --no-control: each path's run is judged once for the question asked, and paths.json, each
    path's results.json and verdicts.md and the exit code all read that one answer (paths.json once said HARNESS
    BLIND where the command exited 0)."""
    from repro.exit_codes import compare_paths as exit_of
    from repro.vllm_integration.gate.outcome import GateRun
    from repro.vllm_integration.gate.paths import write_comparison

    build = VllmBuild("0.26.0", None, UNDER_TEST, "0.26.0")
    case = GateCase(build, GateMode.parse("plain"))
    runs = {p: GateRun(cases=[(case, CaseResult(case.case_id, CLEAN, "", expected="clean"))]) for p in ("old", "new")}
    for need, want in ((False, "PASS"), (True, "HARNESS BLIND")):
        out = tmp_path / str(need)
        out.mkdir()
        differ = write_comparison(runs, out, need_control=need)
        paths = json.loads((out / "paths.json").read_text())["paths"]
        assert {p["outcome"] for p in paths.values()} == {want}
        for folder in (d for d in out.iterdir() if d.is_dir()):
            assert json.loads((folder / "results.json").read_text())["outcome"] == want
            assert f"**Gate: {want}**" in (folder / "verdicts.md").read_text()
        assert not differ and (exit_of(differ, runs["new"].judged().outcome) == 0) == (want == "PASS")
        assert all(r.judged().need_control is need for r in runs.values())


@needs_entry_point
def test_the_report_of_a_build_that_gave_no_answer_and_of_no_control(tmp_path):
    """A build whose every case errored is 'cannot tell', never 'affected no'; with --no-control the cases are not
    counted as controls."""
    broken = write_fake_vllm(tmp_path / "broken", "0.27.0", "broken")
    out = tmp_path / "out"
    args = gate_args(out, "plain", "--no-control")
    assert cli([*args, "--vllm", f"y={broken}", "--self-control", "none"]) == 4
    md = (out / "verdicts.md").read_text()
    assert "| y | under-test | 0.27.0 | **cannot tell** |" in md
    assert "gate: 1 case(s) ran; no positive control needed (--no-control)" in md and "control(s) ran" not in md


@needs_entry_point
def test_the_pytest_tier_runs_each_build_and_mode_through_the_gates_own_run(tmp_path, fakes, monkeypatch):
    """cases/test_vllm_gate.py: one test per build and mode, run by run_gate (only that build, its self control
    beside it, the reference kept in the shared cache folder), judged by the gate's own rules."""
    import cases.test_vllm_gate as tier

    monkeypatch.setattr(tier, "gpu_skip_reason", lambda: None)  # the stand-in builds need no GPU
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path / "cache"))
    from repro.run.pytest_cases import RUN_ENV

    monkeypatch.setenv(RUN_ENV, str(tmp_path / "logs"))  # this test's case logs, never another run's folder
    # forked case processes (REPRO_GATE_LAUNCHER, which the tier's run_gate reads): the spawned launcher's records
    # (test_vllm_gate_fork); a forkserver for the one build each test runs, none for a method it lacks
    monkeypatch.setenv("REPRO_GATE_LAUNCHER", "fork")
    builds = parse_builds(f"good={fakes['good']}", UNDER_TEST, "REPRO_VLLM")
    builds += parse_builds(f"quiet={fakes['stale-quiet']}", CONTROL, "REPRO_VLLM_CONTROL")
    (plain,) = parse_modes("plain")
    props: dict = {}
    tier.test_stale_metadata_vllm_gate((builds[0], plain, builds, "eagle"), lambda k, v: props.__setitem__(k, v))
    assert props["verdict"] == CLEAN and props["role"] == UNDER_TEST
    assert json.loads(props["self_control"])  # the self control ran beside it, in the same run
    assert list((tmp_path / "cache").rglob("*.json")), "the reference was kept in the shared cache"
    assert json.loads(props["counters"]) and list((tmp_path / "logs").rglob("forkserver-good.log"))
    assert not list((tmp_path / "logs").rglob("forkserver-quiet.log"))  # `only` the build under test: no other's
    # the known-bad build silent in plain: not a pass, not a failure by itself (policy rule 5: `pytest --gate`
    # decides over its modes, grouped by the subject it records)
    quiet: dict = {}
    with pytest.raises(pytest.xfail.Exception, match="known-bad vLLM quiet silent in mode plain"):
        tier.test_stale_metadata_vllm_gate((builds[1], plain, builds, "eagle"), lambda k, v: quiet.__setitem__(k, v))
    assert quiet["expected"] == "known-bad" and quiet["subject"] == ["quiet", "eagle", "FLASH_ATTN"]
    # a method the stand-in does not dispatch (it has no init_speculator: EAGLE only): not applicable, said why
    na: dict = {}
    with pytest.raises(pytest.skip.Exception, match="not applicable here: method mtp: .*EAGLE only"):
        tier.test_stale_metadata_vllm_gate((builds[0], plain, builds, "mtp"), lambda k, v: na.__setitem__(k, v))
    assert "EAGLE only" in na["not_applicable"] and na["method"] == "mtp" and na["verdict"] == "skip"


def test_a_stall_is_known_by_its_flag_when_the_deadline_cut_a_case():
    """past_deadline keeps a hang its Stall watch stopped (the flag runner.stalled sets) and turns the deadline's kill
    into a skip; a reason that merely starts like a stall's decides nothing."""
    from repro.case.spec import STALLED
    from repro.run.process import STALLED as STALL_TEXT
    from repro.vllm_integration.gate.process import past_deadline

    case = GateCase(VllmBuild("0.26.0", None, UNDER_TEST, "0.26.0"), GateMode.parse("plain"))
    hang = CaseResult(case.case_id, "hang", f"{STALL_TEXT} for 30 s after 'x' (killed as hung)", wall_s=40.0)
    assert past_deadline(case, replace(hang, flags=[STALLED])).verdict == "hang"
    assert past_deadline(case, hang).verdict == "skip"
