"""A gate case's request (repro.contract.request) is the one record that crosses from the gate to its case process:
made once by the gate, serialized once into one variable, read once and validated whole in the case process, where a
key unknown, missing or of another type is an error naming it, never a default."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace

import pytest

from repro.contract import request
from repro.contract.request import CaseRequest, PluginRequest
from repro.errors import BadRequest, ConfigError
from repro.vllm_integration.gate import run as gate_run
from repro.vllm_integration.gate.case import GateCase, case_env, reference_for
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.plugin import requested
from repro.vllm_integration.releases.builds import UNDER_TEST, VllmBuild
from tests.case_requests import case_request, plugin_request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _doc(req: CaseRequest) -> dict:
    return json.loads(req.to_json())


def test_a_request_comes_back_equal_from_its_json():
    req = case_request(
        plugin_request(audit=True, probe=True, audit_file="/l/a.json", sm_margin=116, poison="int-max"),
        own_alloc="/o/lib.so",
        own_alloc_fill=127,
    )
    assert CaseRequest.from_json(req.to_json()) == req
    assert request.read({request.ENV: req.to_json()}) == req
    assert request.read({}) is None  # a process the gate did not start: no request, nothing asked


@pytest.mark.parametrize(
    "where, key",
    [((), "compile"), (("plugin",), "audit_file"), ((), "plugin")],
    ids=["case", "plugin", "the-plugin-part"],
)
def test_a_missing_key_is_an_error_naming_it(where, key):
    doc = _doc(case_request())
    part = doc
    for w in where:
        part = part[w]
    del part[key]
    named = ".".join((*where, key))
    with pytest.raises(BadRequest, match=f"missing key '{named}'"):
        CaseRequest.from_json(json.dumps(doc))


@pytest.mark.parametrize("where", [(), ("plugin",)], ids=["case", "plugin"])
def test_an_unknown_key_is_an_error_naming_it(where):
    doc = _doc(case_request())
    (doc["plugin"] if where else doc)["sm_margins"] = 3
    with pytest.raises(BadRequest, match=f"unknown key '{'plugin.' if where else ''}sm_margins'"):
        CaseRequest.from_json(json.dumps(doc))


@pytest.mark.parametrize(
    "change, named",
    [
        ({"reference": "false"}, "'reference' of CaseRequest must be bool, not str"),
        ({"own_alloc_fill": True}, "'own_alloc_fill' of CaseRequest must be int or null, not bool"),
        ({"models": None}, "'models' of CaseRequest must be str, not NoneType"),
        ({"plugin": {**asdict(plugin_request()), "sm_margin": "16"}}, "'sm_margin' of PluginRequest must be int"),
        ({"plugin": {**asdict(plugin_request()), "audit": 1}}, "'audit' of PluginRequest must be bool, not int"),
        ({"plugin": "audit"}, "'plugin' must be an object"),
    ],
    ids=["bool-as-text", "bool-as-number", "null-path", "number-as-text", "number-as-bool", "text-as-object"],
)
def test_a_value_of_another_type_is_an_error_naming_its_key(change, named):
    doc = {**_doc(case_request()), **change}
    with pytest.raises(BadRequest, match=named.replace("(", r"\(")):
        CaseRequest.from_json(json.dumps(doc))


def test_a_request_is_checked_when_made_and_its_envelope_when_read():
    with pytest.raises(BadRequest, match="'probe' of PluginRequest must be bool"):
        plugin_request(probe="1")
    for text, why in (
        ("[1]", "a JSON object"),
        ("{", "not JSON"),
        (json.dumps({**_doc(case_request()), "schema": 9}), "schema"),
    ):
        with pytest.raises(BadRequest, match=why):
            CaseRequest.from_json(text)


def _case_env(tmp_path, mode: str, **kw) -> tuple[GateCase, dict[str, str]]:
    build = VllmBuild("b", str(tmp_path / "prefix"), UNDER_TEST)
    case = GateCase(build, GateMode.parse(mode), **kw)
    return case, case_env(case, [build], tmp_path / "c.audit.json", None, lambda: 132, base=dict(os.environ))


def test_a_stand_in_case_process_receives_its_request_through_the_record(tmp_path):
    """The environment the gate gives a case holds the request in its one variable; a process started with it reads
    back what the gate decided (the SM margin from the GPU's SM count, the auditor and its file, the backend), and the
    plugin's own variables of a person's run never reach it."""
    case, env = _case_env(tmp_path, "audit+sm_margin:16", backend="TRITON_ATTN")
    env["REPRO_AUDIT"] = "0"  # a person's own switch in the gate's environment would be popped; here set after
    code = "import json, dataclasses; from repro.contract import request; print(json.dumps(dataclasses.asdict(request.read())))"
    out = subprocess.run(
        [sys.executable, "-c", code], env={**env, "PYTHONPATH": ROOT}, capture_output=True, text=True, check=True
    )
    got = json.loads(out.stdout)
    assert got["plugin"] == {
        "attention_backend": "TRITON_ATTN",
        "probe": True,
        "audit": True,
        "audit_file": str(tmp_path / "c.audit.json"),
        "sm_margin": 132 - 16,
        "poison": None,
        "inject": None,
        "inject_source": "first",
        "weights": "agree",
        "judge_refresh": True,
        "check_replay": True,
    }
    assert (
        got["reference"] is False
        and got["method"] == "eagle"
        and got["models"] == str(tmp_path / f"{case.case_id}.models")
    )
    ref_env = case_env(
        reference_for(case), [case.build], tmp_path / "r.audit.json", None, lambda: 132, base=dict(os.environ)
    )
    ref_req = request.read(ref_env)
    assert ref_req.reference and not (ref_req.plugin.probe or ref_req.plugin.audit or ref_req.plugin.audit_file)
    assert ref_req.plugin.sm_margin == 116  # the reference runs in its cases' SM configuration


def test_the_gates_environment_gives_a_persons_choices_to_the_request_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv("REPRO_WEIGHTS", "margin")
    monkeypatch.setenv("REPRO_INJECT_SOURCE", "last")
    monkeypatch.setenv("REPRO_GATE_INSPECT", "vllm")
    monkeypatch.setenv("REPRO_AUDIT", "1")  # a person's own switch: not a gate case's
    monkeypatch.setenv(request.ENV, "stale")  # an outer request: replaced
    _, env = _case_env(tmp_path, "plain", inject="stale-descriptor")
    req = request.read(env)
    assert (req.plugin.weights, req.plugin.inject_source, req.vllm_inspects) == ("margin", "last", True)
    assert req.plugin.inject == "stale-descriptor" and not req.plugin.audit and "REPRO_AUDIT" not in env


@pytest.mark.parametrize(
    ("var", "value", "allowed"),
    [
        ("REPRO_WEIGHTS", "agreed", "agree, agree-exact, margin, dummy"),
        ("REPRO_INJECT_SOURCE", "middle", "first, last"),
    ],
)
def test_a_choice_the_plugin_would_refuse_is_refused_where_the_gate_builds_the_request(
    tmp_path, monkeypatch, var, value, allowed
):
    """A misspelt REPRO_WEIGHTS or REPRO_INJECT_SOURCE is the gate's ConfigError naming the variable and its values,
    not a request the case's plugin refuses after vLLM started (its check stays as the second line)."""
    monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=f"{var}='{value}': use one of {allowed}"):
        _case_env(tmp_path, "plain")
    with pytest.raises(ValueError, match=value):  # the second line, inside the case
        requested(plugin_request(**{"weights" if var == "REPRO_WEIGHTS" else "inject_source": value}))


@pytest.mark.parametrize(
    ("var", "value", "said"),
    [
        ("REPRO_INJECT_SOURCE", "middle", "REPRO_INJECT_SOURCE='middle'"),
        ("REPRO_CHECKS_OFF", "replays", "REPRO_CHECKS_OFF: 'replays': the checks that can be turned off are"),
    ],
)
def test_the_gate_refuses_a_bad_choice_before_any_case_starts(tmp_path, monkeypatch, var, value, said):
    started = []
    monkeypatch.setattr(gate_run, "run_control", lambda c, *a, **k: started.append(c) or pytest.fail("a case ran"))
    monkeypatch.setenv(var, value)
    build = VllmBuild("b", str(tmp_path / "prefix"), UNDER_TEST)
    with pytest.raises(ConfigError, match=said):
        gate_run.run_gate([build], (GateMode.parse("plain"),), tmp_path / "logs", launcher="spawn", memory=None)
    assert not started


@pytest.mark.parametrize(
    ("off", "want"),
    [(None, (True, True)), ("refresh", (False, True)), ("replay", (True, False)), (" replay,refresh ", (False, False))],
)
def test_the_auditors_checks_are_on_unless_the_gates_environment_turns_them_off(tmp_path, monkeypatch, off, want):
    """The refresh judged and the replay check: on in every audited case's request by default; REPRO_CHECKS_OFF
    turns either off, typed in the request (judge_refresh, check_replay), never a module's switch."""
    if off is not None:
        monkeypatch.setenv("REPRO_CHECKS_OFF", off)
    _, env = _case_env(tmp_path, "audit")
    req = request.read(env)
    assert (req.plugin.judge_refresh, req.plugin.check_replay) == want and req.plugin.audit
    asked = requested(req.plugin)
    assert (asked["judge_refresh"], asked["check_replay"]) == want


def test_the_plugin_request_command_turns_either_check_off(capsys):
    from repro.cli import main  # noqa: PLC0415  the command line, in this process

    assert main(["plugin-request"]) == 0
    on = json.loads(capsys.readouterr().out)["plugin"]
    assert (on["judge_refresh"], on["check_replay"]) == (True, True)
    assert main(["plugin-request", "--no-refresh-judging", "--no-replay-check"]) == 0
    off = json.loads(capsys.readouterr().out)["plugin"]
    assert (off["judge_refresh"], off["check_replay"]) == (False, False)


def test_a_persons_repro_audit_run_has_both_checks_on():
    from repro.vllm_integration import plugin  # noqa: PLC0415  the plugin's reading of a person's variables

    want = plugin.from_environment({"REPRO_AUDIT": "1"})
    assert want.judge_refresh and want.check_replay


def test_the_case_process_refuses_to_run_without_a_request_or_with_a_bad_one():
    env = {k: v for k, v in os.environ.items() if k != request.ENV} | {"PYTHONPATH": ROOT}
    cmd = [sys.executable, "-m", "repro.vllm_integration.gate.worker"]
    none = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert none.returncode == 2 and f"no request: {request.ENV} is not set" in none.stderr
    doc = _doc(case_request())
    del doc["method"]
    bad = subprocess.run(cmd, env={**env, request.ENV: json.dumps(doc)}, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "BadRequest" in bad.stderr and "missing key 'method'" in bad.stderr


def test_a_plugin_request_alone_is_a_persons_auditor():
    from repro.vllm_integration import plugin  # noqa: PLC0415  the plugin's reading of a person's variables

    want = plugin.from_environment({"REPRO_AUDIT": "1", "REPRO_AUDIT_FILE": "a.json"})
    assert isinstance(want, PluginRequest) and want.audit and want.probe and want.audit_file == "a.json"
    assert not (want.inject or want.poison or want.sm_margin) and want.weights == "dummy"
    assert plugin.from_environment({"REPRO_AUDIT": "0"}) is None
    asked = case_request(plugin_request(probe=True))
    assert plugin.from_environment({"REPRO_AUDIT": "1", request.ENV: asked.to_json()}) == asked.plugin  # the gate's


def test_a_persons_plugin_request_printed_by_the_command_is_what_the_plugin_in_their_vllm_run_installs(tmp_path):
    """A person's own vLLM run asks for the plugin's other features (SM margin, poison, injection, weights) with one
    request of the plugin alone, as `python -m repro plugin-request` prints it; it wins over REPRO_AUDIT=1."""
    from repro.vllm_integration import plugin  # noqa: PLC0415  the plugin's reading of a person's variables

    cmd = [sys.executable, "-m", "repro", "plugin-request", "--sm-margin", "16", "--poison", "int-max"]
    cmd += ["--inject", "stale-capture", "--inject-source", "last", "--weights", "margin", "--audit-file", "a.json"]
    env = {**os.environ, "PYTHONPATH": ROOT}
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    env = {request.ENV: out.stdout.strip(), "REPRO_AUDIT": "1"}
    # the audit file as the person named it, from where they are: every process of their vLLM run writes that one
    want = plugin_request(probe=True, audit=True, audit_file=str(tmp_path / "a.json"), sm_margin=16, poison="int-max")
    want = replace(want, inject="stale-capture", inject_source="last", weights="margin")
    assert plugin.from_environment(env) == want
    asked = plugin.requested(plugin.from_environment(env))
    assert (asked["sm_margin"], asked["poison"].name, asked["inject"], asked["weights"]) == (
        16,
        "int-max",
        "stale-capture",
        "margin",
    )
    with pytest.raises(BadRequest, match="missing key 'models'"):  # a gate case process refuses a person's request
        request.read(env)


def test_the_plugin_request_command_refuses_what_the_plugin_would_refuse(capsys):
    from repro.cli import main  # noqa: PLC0415  the command line, in this process

    assert main(["plugin-request", "--poison", "lukewarm"]) == 2
    assert "lukewarm" in capsys.readouterr().err
    assert main(["plugin-request", "--sm-margin", "-1"]) == 2
    assert "sm_margin=-1" in capsys.readouterr().err
    assert main(["plugin-request", "--backend", "NOPE_XYZ"]) == 2  # no backend vLLM could name so
    assert "NOPE_XYZ" in capsys.readouterr().err
    assert main(["plugin-request", "--backend", "TRITON_ATTN"]) == 0 and "TRITON_ATTN" in capsys.readouterr().out
    assert main(["plugin-request", "--no-audit"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert (
        printed["schema"] == request.SCHEMA
        and printed["plugin"]["audit"] is False
        and set(printed) == {"schema", "plugin"}
    )


def test_a_persons_plugin_request_is_validated_whole():
    doc = json.loads(plugin_request().to_json())
    doc["plugin"]["margin"] = 3
    with pytest.raises(BadRequest, match="unknown key 'plugin.margin'"):
        request.plugin_of({request.ENV: json.dumps(doc)})
    del doc["plugin"]["margin"], doc["plugin"]["weights"]
    with pytest.raises(BadRequest, match="missing key 'plugin.weights'"):
        request.plugin_of({request.ENV: json.dumps(doc)})


def test_a_request_classs_field_types_are_read_once_per_class(monkeypatch):
    """Every request made or read checks its fields against the class's type hints; they are read once per class, not
    once per request (nor twice: by the reading and by the checking)."""
    calls = []
    real = request.typing.get_type_hints
    monkeypatch.setattr(request.typing, "get_type_hints", lambda cls: calls.append(cls) or real(cls))
    text = case_request(plugin_request(probe=True)).to_json()
    for _ in range(5):
        CaseRequest.from_json(text)
    assert len(calls) <= 2 and len(set(calls)) == len(calls), calls  # CaseRequest and PluginRequest, at most once each
