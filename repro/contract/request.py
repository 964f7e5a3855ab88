"""One gate case's request: what its process runs (CaseRequest) and what the plugin installs inside vLLM
(PluginRequest, a part of it), built by the gate (repro.vllm_integration.gate.case.case_request), serialized once as
JSON into ONE environment variable of the case process (ENV) and read once there: by the case process
(repro.vllm_integration.gate.worker) and by the plugin in every process vLLM starts (repro.vllm_integration.plugin:
vLLM enters it through its entry point in processes it spawns, which inherit the variable), never by parsing
anything else. A person's own vLLM run outside the gate may give the plugin its part alone in the same variable
(PluginRequest.to_json, printed by `python -m repro plugin-request`; plugin_of reads either).

A request is validated whole when it is read, and when it is made: a key it does not know, a key it lacks, a value of
another type (a bool where a number is asked, a string where a bool is) is a BadRequest naming the key, never a
default put in its place. What a value means (a backend name, a poison fill) is checked by the code that uses it."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import types
import typing
from dataclasses import asdict, dataclass
from typing import Any

from repro.errors import BadRequest

ENV = "REPRO_REQUEST"  # the one variable a gate case's request crosses the process boundary in (JSON)
SCHEMA = 1


@dataclass(frozen=True)
class PluginRequest:
    """What the plugin installs inside vLLM (repro.vllm_integration.plugin.register)."""

    attention_backend: str  # vLLM's name of the backend the hooks go on (and the engine is asked to use)
    probe: bool  # coverage counters: forwards per backend, captures per graph kind
    audit: bool  # the freshness auditor (the probe with it)
    audit_file: str | None  # where the auditor writes its whole report at exit (None: its summary line only)
    sm_margin: int  # FA3 plans and launches for this many fewer SMs (0: vLLM's own calls untouched)
    poison: str | None  # the fill of the entries FA3 never writes (repro.case.poison), None: not poisoned
    inject: str | None  # the self control's form (repro.vllm_integration.plugin.inject.INJECTIONS), None: none
    inject_source: str  # whose capture contents it injects: the target's first or last build (inject.SOURCES)
    weights: str  # the gate model's weights (plugin.weights: agree, margin) or dummy (vLLM's own)
    judge_refresh: bool  # with audit: every draft-decode refresh judged (plugin.refresh); false: counted unjudged
    check_replay: bool  # with audit: the replay check (plugin.replay) where torch has its hook; false: off, said so

    def __post_init__(self) -> None:
        _check_types(self)

    def to_json(self) -> str:
        """A person's request of the plugin alone, for a vLLM run outside the gate (ENV holds it; plugin_of reads it;
        `python -m repro plugin-request` prints one)."""
        return json.dumps({"schema": SCHEMA, "plugin": asdict(self)}, sort_keys=True)


@dataclass(frozen=True)
class CaseRequest:
    """What one gate case process runs (repro.vllm_integration.gate.worker), its plugin's part included."""

    models: str  # the folder the method's target and draft model configs are written to
    reference: bool  # the reference run: the same decoding without CUDA graphs, with log-probabilities
    method: str  # the speculative method (repro.vllm_integration.gate.methods.TABLE)
    compile: str  # the speculative run's torch.compile (gate.worker.COMPILES); a reference never compiles
    vllm_inspects: bool  # vLLM's model-class inspection left in its own process (the gate's REPRO_GATE_INSPECT=vllm)
    own_alloc: str | None  # memcheck:own: the allocator library installed before CUDA starts (repro.run.own_alloc)
    own_alloc_fill: int | None  # the byte its new allocations are filled with (None: not filled)
    plugin: PluginRequest

    def __post_init__(self) -> None:
        _check_types(self)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, **asdict(self)}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CaseRequest:
        return _from_dict(cls, _document(text), "")


def read(environ: dict[str, str] | None = None) -> CaseRequest | None:
    """The request in the environment (ENV), validated; None when it holds none (a process the gate did not start)."""
    text = (os.environ if environ is None else environ).get(ENV)
    return None if text is None else CaseRequest.from_json(text)


def plugin_of(environ: dict[str, str] | None = None) -> PluginRequest | None:
    """What the plugin is asked for by ENV, validated whole: a gate case's request's plugin part, or a person's request
    of the plugin alone (PluginRequest.to_json: the key `plugin` and nothing else of a case); None when ENV is unset.
    A case process given a person's request refuses it (read: a CaseRequest's keys are missing)."""
    text = (os.environ if environ is None else environ).get(ENV)
    if text is None:
        return None
    doc = _document(text)
    if set(doc) != {"plugin"}:
        return _from_dict(CaseRequest, doc, "").plugin
    if not isinstance(doc["plugin"], dict):
        raise BadRequest(f"{ENV}: key 'plugin' must be an object, not {doc['plugin']!r}")
    return _from_dict(PluginRequest, doc["plugin"], "plugin.")


def _document(text: str) -> dict:
    """The JSON object of a request, its schema checked and taken out."""
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise BadRequest(f"{ENV}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise BadRequest(f"{ENV}: a JSON object expected, got {type(doc).__name__}")
    doc = dict(doc)
    if doc.pop("schema", None) != SCHEMA:
        raise BadRequest(f"{ENV}: not a request of schema {SCHEMA}")
    return doc


def _from_dict(cls: type, doc: dict, where: str) -> Any:
    names = [f.name for f in dataclasses.fields(cls)]
    if unknown := sorted(set(doc) - set(names)):
        raise BadRequest(f"{ENV}: unknown key '{where}{unknown[0]}' (a {cls.__name__} has {', '.join(names)})")
    if missing := [n for n in names if n not in doc]:
        raise BadRequest(f"{ENV}: missing key '{where}{missing[0]}' (a {cls.__name__} has no default)")
    hints = _hints(cls)
    values = {}
    for n in names:
        hint = hints[n]
        if dataclasses.is_dataclass(hint):
            if not isinstance(doc[n], dict):
                raise BadRequest(f"{ENV}: key '{where}{n}' must be an object, not {doc[n]!r}")
            values[n] = _from_dict(hint, doc[n], f"{where}{n}.")
        else:
            values[n] = doc[n]
    return cls(**values)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A request class's field types, read once per class (every request made or read checks against them)."""
    return typing.get_type_hints(cls)


def _allowed(hint: Any) -> tuple[type, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return tuple(a for h in typing.get_args(hint) for a in _allowed(h))
    return (type(None),) if hint is None or hint is type(None) else (hint,)


def _check_types(obj: Any) -> None:
    """Each field's value of its annotated type: bool is not a number here, nor a number a bool."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        value, allowed = getattr(obj, f.name), _allowed(hints[f.name])
        ok = any(type(value) is t if t in (bool, int) else isinstance(value, t) for t in allowed)
        if not ok:
            want = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise BadRequest(
                f"{ENV}: key {f.name!r} of {type(obj).__name__} must be {want}, not {type(value).__name__} {value!r}"
            )
