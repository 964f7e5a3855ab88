"""The vLLM gate end to end on CPU, over stand-in vLLM builds (tests/fake_vllm.py): build discovery, the case
process, the plugin loaded through its real entry point, classification, the launch-blocking attribution, the
reference comparison, the gate's exit codes and report. Plus the pieces on their own: modes, token comparison."""

from __future__ import annotations

import importlib.metadata
import json
import types

import pytest
import torch

from repro.case import CaseResult
from repro.cli import main as cli
from repro.descriptors import ConfigError
from repro.poison import parse_poison
from repro.verdicts import CLEAN, CRASH, ERROR, STALE_AUDIT, WRONG
from repro.vllm_integration import plugin
from repro.vllm_integration.builds import CONTROL, UNDER_TEST, build_pythonpath, find_builds, parse_builds
from repro.vllm_integration.gate_run import (
    GateCase,
    GateMode,
    apply_reference,
    compare_tokens,
    parse_modes,
    run_gate,
)
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
    res = CaseResult("c", CLEAN, "")
    apply_reference(res, {"tokens": [[1, 2, 9, 9], [5, 0, 0, 0]]}, CaseResult("r", CLEAN, ""), {"tokens": ref})
    assert res.verdict == WRONG
    res = CaseResult("c", CLEAN, "")
    apply_reference(res, {"tokens": ref}, CaseResult("r", CRASH, "boom"), None)
    assert res.verdict == ERROR and "no reference" in res.reason  # never clean without a reference


@needs_entry_point
def test_gate_end_to_end_on_stand_in_builds(tmp_path, fakes):
    builds = parse_builds(f"good={fakes['good']},wrong={fakes['wrong']}", UNDER_TEST, "REPRO_VLLM")
    builds += parse_builds(f"crash={fakes['stale-crash']},quiet={fakes['stale-quiet']}", CONTROL, "REPRO_VLLM_CONTROL")
    run = run_gate(builds, parse_modes("audit,plain"), tmp_path / "logs", jobs=4, timeout_s=120)
    v = _verdicts(run)
    assert v["good-under-test-audit"].verdict == CLEAN, v["good-under-test-audit"].reason
    assert "audit: 0 stale fields in 1 checks" in v["good-under-test-audit"].evidence
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
    assert run.blind() and "quiet-control-plain" in run.blind()[0]  # a control that came back clean
    assert all(r.vllm_version in ("0.25.1", "0.26.0") for _, r in run.cases)


@needs_entry_point
def test_gate_command_exit_codes_and_report(tmp_path, fakes, capsys):
    out = tmp_path / "out"
    args = ["gate", "--no-installed", "--modes", "plain", "--out", str(out), "--jobs", "2"]
    assert cli([*args, "--vllm", f"0.26.0={fakes['good']}", "--control", f"0.25.1={fakes['stale-crash']}"]) == 0
    doc = json.loads((out / "results.json").read_text())
    assert doc["kind"] == "vllm-gate" and doc["passed"]
    assert {b["build"]: b["affected"] for b in doc["builds"]} == {"0.26.0": False, "0.25.1": True}
    assert "**Gate: PASS**" in (out / "verdicts.md").read_text()
    assert cli([*args, "--vllm", f"0.26.0={fakes['good']}"]) == 3  # no control: HARNESS BLIND
    assert cli([*args, "--vllm", f"0.26.0={fakes['good']}", "--no-control"]) == 0  # a bisect step's answer
    assert json.loads((out / "results.json").read_text())["passed"]  # the report agrees with the exit code
    assert cli([*args, "--vllm", f"x={fakes['stale-crash']}", "--no-control"]) == 1  # affected
    broken = str(write_fake_vllm(tmp_path / "broken", "0.27.0", "broken"))
    assert cli([*args, "--vllm", f"y={broken}", "--control", f"0.25.1={fakes['stale-crash']}"]) == 4  # cannot vouch
    assert json.loads((out / "results.json").read_text())["outcome"] == "CANNOT VOUCH"
    assert cli([*args, "--modes", "nope", "--vllm", f"0.26.0={fakes['good']}"]) == 2
    assert "unknown gate mode" in capsys.readouterr().err


def test_plugin_features_from_the_environment():
    assert plugin.requested({})["audit"] is False
    want = plugin.requested({"REPRO_AUDIT": "1", "REPRO_SM_MARGIN": "116", "REPRO_POISON": "int-max"})
    assert want["audit"] and want["sm_margin"] == 116 and want["poison"].value == 2**31 - 1
    for bad in ({"REPRO_SM_MARGIN": "x"}, {"REPRO_SM_MARGIN": "-1"}, {"REPRO_POISON": "nope"}, {"REPRO_WEIGHTS": "?"}):
        with pytest.raises((ValueError, ConfigError)):
            plugin.requested(bad)


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
    done = plugin.install_fa3_hooks(module, ops, sm_margin=116, poison=parse_poison("int-max"))
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
    assert plugin.margin_weights(m1) == 4
    w0, w1 = m1[0].weight.detach().clone(), m1[1].weight.detach().clone()
    assert not torch.equal(w0, w1) and torch.all(m1[0].bias == 1.0)  # vLLM's dummy weights: equal for equal sizes
    assert 0.08 < float(w0.std()) < 0.17  # N(0, 1/fan_in)
    plugin.margin_weights(m1)
    assert torch.equal(m1[0].weight, w0)  # same name, same seed
    plugin.margin_weights(m2)
    assert not torch.equal(m2.weight, w0)


def test_gate_case_ids_name_build_role_mode():
    b = parse_builds.__globals__["VllmBuild"]("0.25.1", None, CONTROL, "0.25.1")
    c = GateCase(b, GateMode.parse("mps:16"), rep=2)
    assert c.case_id == "stale_metadata-vllm-0.25.1-control-mps16-rep2"
    assert json.loads(c.to_json())["mode"]["sm"] == {"kind": "mps", "sms": 16, "mig_uuid": None}


def test_fresh_prefill_capture_rewrites_the_two_spots_once(tmp_path):
    from repro.vllm_integration.bisect import SPECULATOR, fresh_prefill_capture, main

    tree = tmp_path / "tree"
    spec = tree / SPECULATOR
    spec.parent.mkdir(parents=True)
    spec.write_text(
        "class S:\n    def init(self):\n        self.prefill_cudagraph_manager = PrefillSpeculatorCudaGraphManager(\n"
        "            cfg)\n\n    def capture(self, attn_states):\n        self.prefill_cudagraph_manager.capture(\n"
        "            self._prefill,\n            attn_states,\n            progress_bar_desc='p',\n        )\n"
    )
    (tree / "vllm" / "ext.so").write_text("binary")
    out = fresh_prefill_capture(tree, tmp_path / "fixed")
    text = (out / SPECULATOR).read_text()
    assert "DecodeSpeculatorCudaGraphManager(" in text and "attn_states," not in text
    assert "self._prefill, self.model_state, self.input_buffers" in text and not (out / "vllm" / "ext.so").exists()
    compile(text, "speculator.py", "exec")
    assert main(["fresh-prefill-capture", str(out), str(tmp_path / "again")]) == 2  # already fixed: no match
