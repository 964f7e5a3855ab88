"""What a vLLM gate case must show fired before its clean answer vouches for a build: the one table of it (NEEDS: per
mode kind, the plugin feature that must be installed, the counter that must reach its threshold, the reason when it
did not), and `not_fired`, which adds the engine's own checks (ENGINE_CHECKS, as code). `annotate` (gate_judge)
takes the features a case needs from NEEDS (`features_needed`); `not_fired` and `reference_problems` take the
counters from it. So "what does this PASS rest on?" is answered here: every row that applies to the case, and every
engine check. `recreated_nothing` says when a self control's injection wrote but re-created no defect (the
stale-refresh form), which no verdict of it can be evidence of: gate.judge.vouch makes such a control cannot-vouch."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from repro.contract.channel import (  # the marks of what a recorded record predates: the replays' upgrader's
    BACKENDS,
    COMPILATION,
    DESCRIPTOR_CHECK,
    SPEC_LAYOUT,
    has,
    recorded_before,
)
from repro.errors import MissingKey
from repro.vllm_integration.gate import dynamic_k, sleep
from repro.vllm_integration.gate.case import GateCase
from repro.vllm_integration.gate.methods import speculator_class, vllm_method
from repro.vllm_integration.gate.worker import DEFAULT_COMPILE
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND
from repro.vllm_integration.plugin.inject import STALE_REFRESH

FULL_MODES = ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")


@dataclass(frozen=True)
class Need:
    """One row: in the cases `applies` selects (the mode kind `mode` names), the plugin must announce `feature` as
    installed (references too when `in_reference`), and the probe's counter `counter` must reach `at_least` in the
    case (in its reference too when `in_reference`), else `message(counters)` is the reason the case cannot vouch.
    `keys`: the counter is a dict per capture kind and only the kinds starting with it count."""

    mode: str
    applies: Callable[[GateCase], bool]
    feature: str
    counter: str | None = None
    at_least: int = 1
    message: Callable[[dict], str] | None = None
    keys: str | None = None
    in_reference: bool = False
    at_most: int | None = None  # a counter of what could not be done: it must stay at or below this (at_least unused)
    predates: str | None = None  # the mark of a recorded run from before the counter existed (channel.has): there
    # the key's absence is not read as short; a live record without it is a MissingKey

    def count(self, counters: dict) -> float:
        value = counters.get(self.counter) if self.counter else None
        if self.keys is not None:
            return sum(v for k, v in (value or {}).items() if k.startswith(self.keys) and v)
        return value or 0

    def short(self, counters: dict) -> bool:
        """Did the counter stay below its threshold (or rise above at_most)? False for a row without a counter, and
        for an absent counter in a record marked as predating it (`predates`); MissingKey for a live one."""
        if self.counter is None:
            return False
        if self.predates is not None and not has(counters, self.counter, self.predates, "the counters record"):
            return False
        n = self.count(counters)
        return n > self.at_most if self.at_most is not None else n < self.at_least


def _injection_missed(c: dict) -> str:
    writes = c.get("inject_writes") or {}
    return (
        "the self control's injection reached no draft FULL capture (writes "
        f"{', '.join(f'{k} {v}' for k, v in writes.items()) or 'none'}; target capture builds copied "
        f"{c.get('inject_snapshots', 0)}; passes with nothing to write {c.get('inject_no_source') or 'none'}; "
        f"draft metadata reused {c.get('inject_reused') or 'none'}; another descriptor's given "
        f"{c.get('inject_rebuilt') or 'none'}; draft capture builds per capture manager "
        f"{c.get('inject_builds_by_manager') or 'none'}): "
        "this layout or backend keeps the draft's capture out of its reach"
    )


REFRESH_RECREATED_NOTHING = (
    "the stale-refresh injection changed no refreshed entry of a batch (inject_refresh_changed 0): it re-created no "
    "defect to catch"
)


def recreated_nothing(case: GateCase, counters: dict) -> str | None:
    """Why a self control re-created no defect, None when it did or is not known not to have: the stale-refresh form
    whose injection rewrote refreshes (inject_writes "draft refresh" above 0) but changed no eager refresh in a batch's
    own entries (inject_refresh_changed 0, or absent: the plugin counts it from its first change). One that wrote
    nothing is the captures_injected row's (NEEDS): its injection reached no capture."""
    if case.inject != STALE_REFRESH or not (counters.get("inject_writes") or {}).get("draft refresh"):
        return None
    return None if counters.get("inject_refresh_changed") else REFRESH_RECREATED_NOTHING


def _descriptors_unchecked(c: dict) -> str:
    why = c.get("descriptor_unchecked") or {}
    return (
        f"the descriptor check could not run at {sum(why.values())} FULL capture pass(es) "
        f"({'; '.join(f'{k} ({v})' for k, v in why.items())}): the metadata there is not known to be its descriptor's"
    )


def _sm_margin(case: GateCase) -> bool:
    return case.mode.sm.kind == "sm_margin"


# mode kind -> plugin feature -> counter -> threshold -> the reason when it did not fire. Order is the order of the
# reasons after the engine checks.
NEEDS: tuple[Need, ...] = (
    Need("every case", lambda case: True, "weights", in_reference=True),
    Need("every case but references", lambda case: True, "probe"),  # the counters the engine checks read
    Need(
        "audit",
        lambda case: case.mode.audit,
        "audit",
        counter="checks",
        message=lambda c: "the freshness auditor made 0 checks",
    ),
    Need(  # the descriptor check (plugin.audit.descriptor_mismatches); records from before it lack its counters
        "audit",
        lambda case: case.mode.audit,
        "audit",
        counter="descriptor_checks",
        keys="",
        message=lambda c: "the descriptor check never ran (no FULL capture pass's descriptor found on the stack)",
        predates=DESCRIPTOR_CHECK,
    ),
    Need(
        "audit",
        lambda case: case.mode.audit,
        "audit",
        counter="descriptor_unchecked",
        keys="",
        at_most=0,
        message=_descriptors_unchecked,
        predates=DESCRIPTOR_CHECK,
    ),
    Need(
        "self control (inject)",
        lambda case: bool(case.inject),
        "inject",
        counter="captures_injected",
        keys="draft",
        message=_injection_missed,
    ),
    Need(
        "sm_margin:N",
        _sm_margin,
        "fa3",
        counter="sched_sm_margin",
        message=lambda c: "no get_scheduler_metadata call received the injected sm_margin",
        in_reference=True,
    ),
    Need(
        "sm_margin:N",
        _sm_margin,
        "fa3",
        counter="fwd_sm_margin",
        message=lambda c: "no FA3 forward (torch.ops._vllm_fa3_C.fwd) received the injected sm_margin",
        in_reference=True,
    ),
    Need(  # kept: memory a capture allocated or freed (the GEMM check before the engine captures nothing)
        "memcheck:own",
        lambda case: case.mode.sanitizer == "own",
        "own_allocator",
        counter="own_allocator",
        keys="kept",
        message=lambda c: (
            "no CUDA graph's memory went through memcheck's own allocator (its captures used another allocator or pool)"
        ),
    ),
    Need(  # a dynamic-K method (gate.dynamic_k): its draft decode graphs captured per K, else it tested nothing new
        "dynamic K",
        lambda case: dynamic_k.base_of(case.method) is not None,
        "probe",
        counter="captures_by_k",
        keys="",
        message=lambda c: "a K schedule was configured, but no FULL graph of a K-specialized descriptor was captured",
    ),
    Need(  # a sleep-and-wake scenario (gate.sleep): the engine slept and woke before it generated
        "sleep",
        lambda case: sleep.level_of(case.method) is not None,
        "probe",
        counter="slept",
        message=lambda c: "a sleep-and-wake scenario whose engine never reported that it slept and woke",
    ),
    Need(
        "poison:FILL",
        lambda case: bool(case.mode.poison),
        "fa3",
        counter="entries_poisoned",
        message=lambda c: (
            f"0 scheduler-metadata entries poisoned ({c.get('sched_calls', 0)} get_scheduler_metadata calls seen)"
        ),
    ),
)

# The engine's own checks, every case but references (not_fired, as code: they read the engine's resolved
# configuration and several counters at once):
ENGINE_CHECKS = (
    "engine: a REPRO_ENGINE record (the engine configuration and counters) was reported",
    "runner: vLLM's V2 model runner (model_runner_v2)",
    "backend: attention forwards through the hooked impl of the case's backend (counters' backends); FLASH_ATTN: FA3",
    "graphs: a FULL cudagraph mode (FULL_MODES) and a CUDA graph capture that ran an attention forward",
    "compile: under --compile none, the engine's compilation mode NONE (a live record without the key cannot vouch)",
    "speculative decoding: a method and k configured, and vLLM counted drafts",
    "method: the method vLLM ran (its engine's config, the runner the plugin saw capturing) is the one asked for, "
    "and its speculator the class the build's files resolve that method to (method_problems)",
    "spec layout: one the auditor knows (plugin.KNOWN_SPEC_LAYOUTS; a live record without the key cannot vouch)",
)


def applying(case: GateCase, reference: bool | None = None) -> list[Need]:
    """The rows of NEEDS a case (or, reference=True, its reference) rests on."""
    ref = case.reference if reference is None else reference
    return [n for n in NEEDS if n.applies(case) and (n.in_reference or not ref)]


def features_needed(case: GateCase) -> set[str]:
    """The plugin features the case's process must announce as installed."""
    return {n.feature for n in applying(case)}


def unmet(case: GateCase, counters: dict) -> list[str]:
    """The reasons of the rows whose counter stayed below its threshold, or that a live record lacks (MissingKey)."""
    out = []
    for n in applying(case):
        try:
            if n.short(counters):
                out.append(n.message(counters) if n.message else n.counter)
        except MissingKey as e:
            out.append(str(e))
    return out


def said(record: dict | None, key: str, mark: str, what: str, out: list[str]) -> bool:
    """Does the record hold key (channel.has); a live record without it adds MissingKey's words to `out` and reads
    as not holding it, as does a recorded one marked as predating it (`mark`)."""
    try:
        return has(record, key, mark, what)
    except MissingKey as e:
        out.append(str(e))
        return False


def descriptor_check_existed(counters: dict) -> bool:
    """Did the auditor's descriptor check exist when these counters were written: False only for a recorded run the
    replays' upgrader marked as predating it (a live record without its counters is not excused)."""
    return "descriptor_checks" in counters or DESCRIPTOR_CHECK not in recorded_before(counters)


def not_fired(case: GateCase, identity: dict | None) -> list[str]:
    """What this case exists to exercise and did not: the engine's resolved configuration (ENGINE_CHECKS) and the
    mode's own counters (NEEDS), from what the case process reported. Empty when everything fired."""
    if case.reference:
        return []
    if not identity or not identity.get("engine"):
        return ["the case process reported no engine configuration and no counters (no REPRO_ENGINE line)"]
    e, c = identity["engine"], identity.get("counters") or {}
    out = []
    if not e.get("model_runner_v2"):
        out.append(f"not the V2 model runner (runner: {e.get('model_runner') or 'none seen'})")
    backend = case.backend
    if said(c, "backends", BACKENDS, "the counters record", out):
        by_backend = c.get("backends") or {}
    else:  # a recorded run from before the per-backend count: attention_forwards is FLASH_ATTN's (a live one: none)
        by_backend = {DEFAULT_BACKEND: c.get("attention_forwards", 0)} if BACKENDS in recorded_before(c) else {}
    if not by_backend.get(backend):
        seen = ", ".join(f"{k} {v}" for k, v in by_backend.items() if v) or "none"
        out.append(
            f"no attention forward went through the hooked {backend} impl (forwards counted per backend: {seen}; "
            f"requested {e.get('attention_backend_requested')}: another backend, or renamed classes)"
        )
    elif backend == DEFAULT_BACKEND:
        versions = c.get("fa_versions") or {}
        if set(versions) != {"3"}:
            out.append(f"FlashAttention version {', '.join(sorted(versions)) or 'unknown'}, not FA3")
    mode = e.get("cudagraph_mode")
    if mode not in FULL_MODES:
        out.append(f"cudagraph mode {mode}: no FULL CUDA graphs")
    elif not sum((c.get("captures_with_attention") or {}).values()):
        out.append(f"cudagraph mode {mode}, but no CUDA graph capture ran an attention forward (no FULL graph seen)")
    compiled = e.get("compilation_mode")
    if case.compile != DEFAULT_COMPILE and "compilation_mode" not in e and COMPILATION not in recorded_before(e):
        out.append(f"--compile {case.compile}: the engine record reports no compilation mode (a live record lacks it)")
    elif case.compile != DEFAULT_COMPILE and compiled is not None and compiled != "NONE":
        out.append(
            f"--compile {case.compile} asked for no torch.compile, but the engine's compilation mode is {compiled}"
        )
    if not e.get("speculative_method") or not e.get("num_speculative_tokens"):
        out.append(
            f"no speculative decoding (method {e.get('speculative_method')}, k {e.get('num_speculative_tokens')})"
        )
    else:
        acc = identity.get("acceptance") or {}
        drafts = acc.get("spec_decode_num_drafts")
        if isinstance(drafts, (int, float)) and drafts == 0:
            out.append("speculative decoding configured, but vLLM counted 0 drafts")
    # a recorded run from before the key: its layout was not reported; a live record without it: said, not known
    known = (
        c.get("spec_layout_known") if said(c, "spec_layout_known", SPEC_LAYOUT, "the counters record", out) else None
    )
    if known is False:
        out.append(
            f"speculative-decoding layout {c.get('spec_layout') or 'none found'} is not one the auditor knows "
            "(plugin.KNOWN_SPEC_LAYOUTS)"
        )
    runs_as = vllm_method(case.method)
    speculator = speculator_class(case.build.package_dir, runs_as) if c.get("speculator") else None
    return out + method_problems(case.method, e, c, speculator=speculator, runs_as=runs_as) + unmet(case, c)


def _ran(engine: dict, counters: dict, asked: str, runs_as: str) -> list[tuple[str, str, str]]:
    """(where it was read, the method, what it should say) for each record of the speculative method vLLM ran: the
    case process's request names the gate's method (`asked`), vLLM's own records the method vLLM was configured with
    (`runs_as`: a scenario's base method)."""
    out = [("the case process's request", engine.get("method"), asked)]  # the pair the worker built and configured
    out += [("vLLM's speculative config", engine.get("speculative_method"), runs_as)]
    seen = [*(counters.get("speculative_methods") or {})] or [counters.get("speculative_method")]
    out += [("the model runner the plugin saw capturing", m, runs_as) for m in seen]
    return [(where, str(m), want) for where, m, want in out if m]


def method_problems(
    asked: str | None,
    engine: dict | None,
    counters: dict | None,
    speculator: str | None = None,
    manager: str | None = None,
    runs_as: str | None = None,
) -> list[str]:
    """The speculative method (and speculator and capture-manager classes) vLLM ran against what was asked for: one
    reason per disagreement, both named (a mismatch cannot vouch: the run judged is not the run asked for). `asked`
    None: no method asked for (nothing compared); `speculator`, `manager`: the class names expected, compared only
    where the plugin recorded them (counters' speculator; the capture managers of full_captures_by_manager); `runs_as`:
    the method vLLM is configured with for `asked` (a gate scenario's base method, methods.vllm_method; default
    `asked`)."""
    e, c, out = engine or {}, counters or {}, []
    if asked:
        for where, ran, want in _ran(e, c, asked, runs_as or asked):
            if ran != want:
                shown = asked if want == asked else f"{asked} (vLLM's method {want})"
                out.append(f"speculative method asked for: {shown}; {where} ran: {ran}")
    seen = c.get("speculator")
    if speculator and seen and seen != speculator:
        out.append(f"speculator class expected: {speculator}; vLLM ran: {seen}")
    managers = sorted(k for k, v in (c.get("full_captures_by_manager") or {}).items() if v)
    if manager and managers and not any(m.split(".")[0] == manager or m.startswith(manager) for m in managers):
        out.append(f"capture manager expected: {manager}; vLLM's FULL captures were by: {', '.join(managers)}")
    return out
