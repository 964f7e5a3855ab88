"""What a vLLM gate case is and the environment it runs in: a vLLM build x a detection mode (x a repetition), its
reference (the same build in the same SM configuration, the same speculative decoding without CUDA graphs), the
environment of its process, and the expectation (repro.judge.policy) fixed before it runs.

Its detection mode (`--modes`): repro.vllm_integration.gate.modes.

Every case runs one speculative method (`--methods`, repro.vllm_integration.gate.methods: eagle, eagle3, draft_model,
mtp, dflash; its id names it unless it is eagle), with its own reference and self control; a method the build does not
have, or whose speculator captures no FULL graph, is not applicable there (a skip saying why, never clean).

Every mode also runs as a self control of a build (`inject`), once per form of the injection (INJECTIONS: the target's
capture contents in the draft's buffers, `stale-capture`; another descriptor's metadata, object and buffers together,
`stale-descriptor`, whose case ids say it): the same build, engine, kernels and SM configuration with the capture defect
re-created inside it (repro.vllm_integration.plugin.inject), a positive control that ran in this environment. In the
audit modes a self control must be caught by the auditor itself (judge.vouch), not by a fault alone. Builds under test
must be `clean` in every mode and repetition; a control (a known-bad build, or a self control) must be detected with
kernel evidence (fault, hang, wrong tokens) in every gating mode, or by the audit in the audit mode (`expected`): a
known-bad build in at least one of its modes and methods, a silent path listed where another control showed the bug
on it (policy rule 5), a self control outside the audit in at least one of its injection forms per mode (rule 6),
every form by the audit."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from repro import CHECKOUT
from repro.case.spec import SmConfig
from repro.contract import request
from repro.contract.request import CaseRequest, PluginRequest
from repro.errors import ConfigError, Unavailable
from repro.judge import policy
from repro.judge.control import KNOWN_BAD, SELF_CONTROL
from repro.run import own_alloc
from repro.run.process import StallRule
from repro.run.sanitizer import sanitizer_env
from repro.run.smcontrol import MpsDaemon
from repro.vllm_integration.gate import dynamic_k
from repro.vllm_integration.gate.methods import DEFAULT_METHOD
from repro.vllm_integration.gate.modes import GateMode
from repro.vllm_integration.gate.worker import COMPILES, DEFAULT_COMPILE, INSPECT_ENV
from repro.vllm_integration.plugin import BACKEND_ENV, FILE_ENV, RUN_ENV, RUN_VARS, checks_of
from repro.vllm_integration.plugin import ENV as AUDIT_ENV
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND
from repro.vllm_integration.plugin.inject import INJECTIONS, SOURCES, STALE_CAPTURE, STALE_K
from repro.vllm_integration.plugin.weights import AGREE, DUMMY, WEIGHTS
from repro.vllm_integration.releases.builds import SITE_DIRS_ENV, UNDER_TEST, VllmBuild, build_pythonpath, site_dirs

BASE_ENV = {
    "VLLM_USE_V2_MODEL_RUNNER": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # engine in the case process: one process, one CUDA context
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the V2 sampler probes FlashInfer otherwise
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
}
WEIGHTS_ENV, INJECT_SOURCE_ENV, CHECKS_OFF_ENV = "REPRO_WEIGHTS", "REPRO_INJECT_SOURCE", "REPRO_CHECKS_OFF"  # choices
# the plugin's variables for a person's own vLLM run: never passed on to a gate case, whose request is the one
PLUGIN_OWN_VARS = (AUDIT_ENV, FILE_ENV, BACKEND_ENV, RUN_ENV, *RUN_VARS)


# Silent this long once vLLM began capturing CUDA graphs, a case process hangs. Measured on the H200 in every recorded
# case of a build under test (72 of them: 0.20.2-0.33.0, cold and warm, full GPU, sm_margin, MPS, both backends), the
# longest gap between two log lines after the first capture was 28 s (the lines in between included); 0.25.1's draft
# prefill captures took minutes each, printing nothing for 55, 60 and 144 s at sm_margin:66 (clean at 290 s of its
# 300 s timeout) and 54 and 68 s under MPS at 8 and 16 SMs (killed at its 150 s timeout); the records:
# docs/history.md.
CAPTURE_STALL = StallRule("Capturing CUDA graphs", 45.0)


@dataclass(frozen=True)
class GateCase:
    build: VllmBuild
    mode: GateMode
    reference: bool = False
    rep: int = 0
    attempt: int = 0  # a self control's attempt after one that decoded without a fault (process.SELF_CONTROL_ATTEMPTS)
    launch_blocking: bool = False
    timeout_s: float = 300.0
    backend: str = DEFAULT_BACKEND  # vLLM's attention backend (attention_backend=...)
    compile: str = DEFAULT_COMPILE  # the speculative run's torch.compile (COMPILES); references never compile
    inject: str | None = None  # the self control's injection (vllm_integration.plugin.inject), None: the build as is
    deadline_at: float | None = None  # `gate --deadline`: when (time.time()) the run ends; every process stops by then
    method: str = DEFAULT_METHOD  # the speculative method (repro.vllm_integration.gate.methods), a case parameter
    # a plain-mode crash rerun with CUDA_LAUNCH_BLOCKING=1 to name its kernel (gate.process.attributable); plan leaves
    # a self control's off unless asked (`gate --name-control-kernels`): its fault is the mode's evidence whichever
    # kernel faulted, and its rerun beside it was a third of a warm default run's process-seconds
    name_kernel: bool = True

    @property
    def stall(self) -> StallRule | None:
        """When the case's process counts as hung before its timeout (repro.run.process.Stall): CAPTURE_STALL, but
        never under compute-sanitizer, where a capture's kernels run up to a hundred times slower and quiet is no
        sign of a hang (results/h200-memcheck-own-guard: 0.25.1's draft prefill captures 18.7 s each, still
        advancing, when it was stopped); a memcheck case ends by its timeout."""
        return None if self.mode.sanitizer else CAPTURE_STALL

    @property
    def begun_marker(self) -> str:
        """vLLM's words that its CUDA graph captures had begun (CAPTURE_STALL's marker), under memcheck too, whose stall
        watch is off: classify flags a timeout after them (CAPTURING)."""
        return CAPTURE_STALL.marker

    @property
    def sanitizer_padding(self) -> int | None:
        """compute-sanitizer's guard bytes after every allocation (repro.run.runner): memcheck:own only."""
        return own_alloc.PADDING if self.mode.sanitizer == "own" else None

    @property
    def is_control(self) -> bool:
        """A positive control: a known-bad build, or any build's self control."""
        return self.inject is not None or self.build.role != UNDER_TEST

    @property
    def control_kind(self) -> str | None:
        """What kind of positive control this case is (the report says which each mode relied on)."""
        if self.inject is not None:
            return SELF_CONTROL
        return KNOWN_BAD if self.build.role != UNDER_TEST else None

    @property
    def case_id(self) -> str:
        what = f"reference-{self.mode.sm.label}" if self.reference else self.mode.label
        role = SELF_CONTROL if self.inject is not None else self.build.role
        parts = ["stale_metadata", "vllm", self.build.label, role, what]
        if self.backend != DEFAULT_BACKEND:  # FLASH_ATTN ids stay as recorded
            parts.insert(4, self.backend.lower())
        if self.compile != DEFAULT_COMPILE and not self.reference:  # inductor ids stay as recorded
            parts.insert(4, f"compile-{self.compile}")
        if self.method != DEFAULT_METHOD:  # EAGLE ids stay as recorded
            parts.insert(4, self.method.replace("_", "-"))
        if self.inject not in (None, STALE_CAPTURE):  # the first form's ids stay as recorded; the others say theirs
            parts.insert(4, self.inject)
        if self.rep:
            parts.append(f"rep{self.rep}")
        if self.attempt:
            parts.append(f"attempt{self.attempt + 1}")
        if self.launch_blocking:
            parts.append("launch-blocking")
        return "-".join(parts)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_dict(cls, d: dict) -> GateCase:
        """The inverse of to_json (results.json keeps it as each result's spec)."""
        mode = {**d["mode"], "sm": SmConfig(**d["mode"]["sm"])}
        return cls(**{**d, "build": VllmBuild(**d["build"]), "mode": GateMode(**mode)})


def reference_for(case: GateCase) -> GateCase:
    """The reference of a case: the same build, method, backend and SM configuration, no CUDA graphs (its process runs the
    same draft: gate.llm_kwargs), nothing injected (a self control is judged against its build's own reference)."""
    mode = GateMode(f"reference-{case.mode.sm.label}", sm=case.mode.sm)
    return replace(
        case,
        mode=mode,
        reference=True,
        rep=0,
        attempt=0,
        launch_blocking=False,
        inject=None,
        compile=DEFAULT_COMPILE,
        name_kernel=True,
    )


def case_env(
    case: GateCase,
    builds: list[VllmBuild],
    audit_file: Path,
    mps: MpsDaemon | None,
    total_sms: Callable[[], int],
    base: dict[str, str] | None = None,
    device: str | None = None,
    models: str | Path | None = None,
) -> dict[str, str]:
    """The environment of one gate case process (on `device`, a CUDA_VISIBLE_DEVICES value, when placed), its request
    (case_request) in the one variable repro.contract.request.ENV; `models`: the folder its model configs go to (else
    one of its own beside its logs). Raises Unavailable when the machine cannot give the mode."""
    env = dict(os.environ if base is None else base)
    for k in (*PLUGIN_OWN_VARS, request.ENV, "CUDA_LAUNCH_BLOCKING"):
        env.pop(k, None)
    user = dict(env)  # the gate's environment: a person's choices (WEIGHTS_ENV, ...) are read from it
    env.update(BASE_ENV)
    root = str(CHECKOUT)
    path = build_pythonpath(case.build, builds, env.get("PYTHONPATH"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (path, root) if p)
    env[SITE_DIRS_ENV] = site_dirs(case.build)  # their .pth files too (releases.builds.add_site_dirs)
    # torch.compile artifacts of concurrent cases must not share one folder; inductor's own cache locks itself
    env["VLLM_CACHE_ROOT"] = str(audit_file.parent / f"{case.case_id}.vllm-cache")
    mode = case.mode
    sm_margin = 0
    if mode.sm.kind == "sm_margin":
        total = total_sms()
        if mode.sm.sms > total:
            raise ConfigError(f"sm_margin:{mode.sm.sms}: this GPU has {total} SMs")
        sm_margin = total - mode.sm.sms
    elif mode.sm.kind == "mps":
        if mps is None:
            raise Unavailable("MPS case without an MPS daemon")
        env.update(mps.client_env(mode.sm.sms, total_sms()))
    elif mode.sm.kind != "full":
        raise ConfigError(f"gate SM restriction {mode.sm.kind!r} is not supported (full, mps:N, sm_margin:N)")
    own = fill = None
    if mode.sanitizer and not case.reference:
        if mode.sanitizer == "async":
            env = sanitizer_env(env)
        else:  # torch's caching allocator: inductor's launcher fails under memcheck with cudaMallocAsync
            env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if mode.sanitizer == "own":  # built once per source text into own_alloc.build_folder() (never into a run's
            own = str(own_alloc.build(guard=own_alloc.guard_wanted(user)))  # logs: no binary); the worker installs it
            try:
                fill = own_alloc.fill_byte(user.get(own_alloc.FILL_ENV))
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if case.launch_blocking:
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    models = audit_file.parent / f"{case.case_id}.models" if models is None else models
    env[request.ENV] = case_request(case, audit_file, models, sm_margin, own, fill, user).to_json()
    return env


def case_request(
    case: GateCase,
    audit_file: Path,
    models: str | Path,
    sm_margin: int,
    own_alloc_lib: str | None,
    own_alloc_fill: int | None,
    environ: dict[str, str],
) -> CaseRequest:
    """What one gate case process runs and what its plugin installs (repro.contract.request), decided here once: a
    reference runs without the probe, the auditor, the poison, the injection and memcheck's allocator, with the SM
    configuration and the weights of its cases; environ is the gate's (persons_choices, worker.INSPECT_ENV)."""
    case_only, (weights, inject_source, checks) = not case.reference, persons_choices(environ)
    plugin = PluginRequest(
        attention_backend=case.backend,
        probe=case_only,  # coverage counters in every case but the references
        audit=case.mode.audit and case_only,
        audit_file=str(audit_file) if case.mode.audit and case_only else None,
        sm_margin=sm_margin,
        poison=case.mode.poison if case_only else None,
        inject=case.inject if case_only else None,
        inject_source=inject_source,
        weights=weights,
        **checks,  # judge_refresh, check_replay: on unless REPRO_CHECKS_OFF names them
    )
    return CaseRequest(
        models=str(models),
        reference=case.reference,
        method=case.method,
        compile=case.compile,
        vllm_inspects=environ.get(INSPECT_ENV) == "vllm",
        own_alloc=own_alloc_lib if case_only else None,
        own_alloc_fill=own_alloc_fill if own_alloc_lib and case_only else None,
        plugin=plugin,
    )


def persons_choices(environ: dict[str, str]) -> tuple[str, str, dict[str, bool]]:
    """(weights, inject_source, plugin.checks_of's) a person chose in the gate's environment (unset: AGREE, the first
    source, every check on), checked here and by run_gate before any case starts, and again in the case (requested)."""
    weights, source = environ.get(WEIGHTS_ENV) or AGREE, environ.get(INJECT_SOURCE_ENV) or SOURCES[0]
    for var, value, allowed in ((WEIGHTS_ENV, weights, (*WEIGHTS, DUMMY)), (INJECT_SOURCE_ENV, source, SOURCES)):
        if value not in allowed:
            raise ConfigError(f"{var}={value!r}: use one of {', '.join(allowed)} (or leave it unset)")
    return weights, source, checks_of(environ, CHECKS_OFF_ENV)


def expected(case: GateCase) -> str:
    """The policy expectation (repro.judge.policy) of a gate case: clean (a build under test), audit (a self control in
    the audit mode, each form its own: the auditor's stale views from the engine count too), any-form (a self control
    outside the audit: kernel evidence from it or from another injection form of it in the same mode, a silent form
    listed: policy rule 6; the injection fills FA3's never-written entries, so its symptom does not hang on
    leftovers), known-bad (a known-bad build in any mode: kernel evidence, or in the audit the engine's stale views;
    a silent mode or method is listed, not failed, when another caught the build: policy rule 5, since a defect lives
    on one capture path) or recorded (memcheck on a control: what it finds is recorded, not required)."""
    if not case.is_control:
        return policy.EXPECT_CLEAN
    if not case.mode.gating:
        return policy.RECORDED
    if case.inject is not None:
        return policy.AUDIT if case.mode.audit else policy.ANY_FORM
    return policy.KNOWN_BAD_BUILD


def subject_of(case: GateCase, expect: str) -> tuple[str, ...] | None:
    """What policy rules 5 and 6 judge a control over: a known-bad build (label, then its variant: method, backend;
    rule 5 judges the build over every variant and mode), or a self control outside the audit (one subject for its
    injection forms in one mode and repetition); None else."""
    if expect == policy.ANY_FORM:
        return (case.build.label, case.method, case.backend, case.mode.name, f"rep{case.rep}")
    return (case.build.label, case.method, case.backend) if case.control_kind == KNOWN_BAD else None


SELF_CONTROL_CHOICES = ("under-test", "all", "none")


def self_controls_for(build: VllmBuild, which: str) -> bool:
    """Does this build get a self control: `under-test` (the default: every build under test), `all` (known-bad
    builds too: the injection's fidelity beside the real defect) or `none`."""
    if which not in SELF_CONTROL_CHOICES:
        raise ConfigError(f"--self-control {which!r}: use {', '.join(SELF_CONTROL_CHOICES)}")
    return which == "all" or which == "under-test" and build.role == UNDER_TEST


def _forms(method: str, forms: tuple[str, ...]) -> tuple[str | None, ...]:
    """A method's cases: the build as is (None), then each self-control form asked for, its own forms added (stale-k
    for a dynamic-K method, which no other method has), each once."""
    own = dynamic_k.forms_for(method)
    return tuple(dict.fromkeys((None, *(f for f in forms if f != STALE_K or own), *own)))


def plan(
    builds: list[VllmBuild],
    modes: tuple[GateMode, ...],
    repeat: int,
    timeout_s: float,
    backends: tuple[str, ...] = (DEFAULT_BACKEND,),
    self_control: str = "under-test",
    compile: str = DEFAULT_COMPILE,
    methods: tuple[str, ...] = (DEFAULT_METHOD,),
    forms: tuple[str, ...] = INJECTIONS,
    control_kernels: bool = False,
) -> list[GateCase]:
    """Every case: build x method x backend x mode x repetition, and each build's self controls (self_controls_for:
    one per injection form, `forms`) in every method and mode beside its cases. sm_margin and poison hook FA3's calls:
    with another backend they are refused. `compile`: COMPILES. A method the build lacks: methods.not_applicable.
    control_kernels: a self control's plain crash rerun to name its kernel too (GateCase.name_kernel)."""
    if compile not in COMPILES:
        raise ConfigError(f"--compile {compile!r}: use one of {', '.join(COMPILES)}")
    if repeat < 1:
        raise ConfigError("--repeat must be at least 1")
    fa3_only = [m.name for m in modes if m.hooks_fa3]
    if fa3_only and any(b != DEFAULT_BACKEND for b in backends):
        raise ConfigError(f"mode {fa3_only[0]} hooks FA3's calls: run it with --backends {DEFAULT_BACKEND} only")
    return [
        GateCase(b, m, rep=r, timeout_s=timeout_s, backend=be, inject=inj, compile=compile, method=meth, name_kernel=k)
        for b in builds
        for meth in methods
        for inj in (_forms(meth, forms) if self_controls_for(b, self_control) else (None,))
        for k in (inj is None or control_kernels,)
        for be in backends
        for m in modes
        for r in range(repeat)
    ]
