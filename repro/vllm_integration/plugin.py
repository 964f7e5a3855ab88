"""The harness inside vLLM, as a general plugin (entry point group `vllm.general_plugins`). vLLM loads it in every
process it starts; each feature is off unless its environment variable turns it on:

- REPRO_ATTENTION_BACKEND=NAME  the attention backend the probe and the auditor hook, named as vLLM names it
                          (FLASH_ATTN when unset; TRITON_ATTN, FLASHINFER, or any backend vLLM's registry knows: see
                          repro.vllm_integration.backend_fields). Set it to the backend the engine is asked to use
                          (LLM(attention_backend=NAME)): the hooks go on that backend's classes only, and a backend
                          whose classes are not found is an error line, never a silent clean run.
- REPRO_PROBE=1           coverage counters (every gate case but the references): the backend impl's forward calls
                          (per backend) and, for FLASH_ATTN, the FA version of the impl that made them, and every CUDA graph capture (torch.cuda.graph)
                          with its graph kind (target decode, target mixed, draft prefill, draft decode, read from the
                          vLLM objects on the capture's call stack; "unknown kind" when none says) and whether an
                          attention forward ran inside it (a FULL graph). The model runner class seen capturing.
- REPRO_AUDIT=1           freshness auditor (implies the probe): wraps the backend's <X>MetadataBuilder.build and
                          build_for_cudagraph_capture (record what every tensor of each build's metadata shows, by the
                          backend's field table) and <X>Impl.forward (before every eager forward, check they still
                          show it); at the end of every capture, the metadata its attention forwards used is checked
                          too (what the graph baked in). Nothing is copied to the host while a graph is captured.
                          Where the builder has update_draft_decode_metadata (vLLM 0.28 on: the fused draft loop
                          refreshes the draft-decode metadata in place, inside the captured graph), an eager refresh
                          becomes the metadata's new reference, and a refresh inside a capture marks the fields it
                          rewrites as the graph's to compute (not compared at that capture's end). Findings go to
                          stderr as `REPRO_AUDIT <json>` lines and, at exit, to REPRO_AUDIT_FILE.
- REPRO_SM_MARGIN=N       FA3 plans and launches for N fewer SMs: sm_margin passed to vLLM's get_scheduler_metadata
                          and to every torch.ops._vllm_fa3_C.fwd call (vLLM itself always passes 0). Counted per call.
- REPRO_POISON=<fill>     the entries FA3's get_scheduler_metadata never writes are filled (repro.poison) before vLLM
                          copies them into its persistent buffer, so a stale read does not depend on leftover memory.
                          The entries poisoned are counted.
- REPRO_INJECT=stale-capture  the self control: the defect of vLLM 0.21.0-0.25.1 re-created inside this build (the
                          draft's FULL captures run on buffers holding the target's last capture build;
                          repro.vllm_integration.inject). Counted per capture kind (captures_injected).
- REPRO_WEIGHTS=agree     after vLLM's DummyModelLoader, the gate's constructed weights (repro.vllm_integration.
                          weights): a target decided by a wide margin at every token and an EAGLE draft that agrees
                          with it. `margin`: every parameter redrawn from a per-name seed (near ties, no acceptance).
                          vLLM's own dummy weights (uniform +-1e-3) give near-tied logits that flip with the SM count.

Each feature that installed is announced as a `REPRO_PLUGIN {"installed": ...}` line, and only then; a hook that
could not be installed is a `REPRO_PLUGIN {"error": ...}` line (the gate turns either into the case's verdict). The
counters (COUNTERS) are printed at exit as `REPRO_COUNTERS <json>`; the gate process prints them with the engine's
configuration after generate (repro.vllm_integration.gate). With the probe on, the counters also name the
speculative-decoding layout of the vLLM that loaded the plugin (`spec_layout`, read from its files as
repro.vllm_integration.source_check does) and whether the auditor knows it (`spec_layout_known`: a layout the
recorded wheels show, KNOWN_SPEC_LAYOUTS); a gate must not vouch for a run whose layout it does not know. Written
against the names in vllm/v1/attention/backends/ (backend_fields); anything not found is reported, never guessed."""

from __future__ import annotations

import atexit
import copy
import functools
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from repro.channel import emit
from repro.tags import AUDIT_TAG, COUNTERS_TAG, PLUGIN_TAG
from repro.vllm_integration.audit import FreshnessAuditor, layout_of
from repro.vllm_integration.backend_fields import (
    DEFAULT_BACKEND,
    FLASH_ATTN,
    BackendFields,
    backend_for,
    find_classes,
    tensor_fields,
    unlisted,
)
from repro.vllm_integration.inject import (
    INJECT_ENV,
    INJECT_SOURCE_ENV,
    INJECTIONS,
    SOURCES,
    StaleCaptureInjector,
    bump,
    capture_role,
    is_draft_frame,
)
from repro.vllm_integration.weights import DUMMY, WEIGHTS
from repro.vllm_integration.weights import install as install_weights

ENV, FILE_ENV, PROBE_ENV = "REPRO_AUDIT", "REPRO_AUDIT_FILE", "REPRO_PROBE"
SM_MARGIN_ENV, POISON_ENV, WEIGHTS_ENV = "REPRO_SM_MARGIN", "REPRO_POISON", "REPRO_WEIGHTS"
BACKEND_ENV = "REPRO_ATTENTION_BACKEND"
# the V2 speculative-decoding layouts the auditor was checked against (the recorded wheels 0.23.0-0.33.0,
# results/vllm-versions.json; a CPU test keeps the two equal): another layout cannot be vouched for
KNOWN_SPEC_LAYOUTS = ("autoregressive", "target_dependent_ar")
AUDITOR = FreshnessAuditor()
_INJECTOR: dict[str, StaleCaptureInjector] = {}  # "on" -> the injector, when REPRO_INJECT asked for one
_installed: set[str] = set()
UNKNOWN_KIND = "unknown kind"


def new_counters() -> dict[str, Any]:
    return {
        "captures": {},  # graph kind -> CUDA graph captures seen
        "captures_with_attention": {},  # kind -> captures an attention forward ran in (FULL graphs)
        "captures_audited": {},  # kind -> captures whose attention metadata the auditor checked at capture end
        "captures_stale": {},  # kind -> of those, captures with stale views
        "checks": 0,  # auditor checks (eager forwards and capture ends)
        "views_checked": 0,  # views compared over those checks
        "attention_forwards": 0,  # hooked <X>Impl.forward calls, eager and captured, every backend together
        "backends": {},  # attention backend name -> its hooked forwards
        "fa_versions": {},  # FLASH_ATTN only: FA version of the impl ("3", or "unknown") -> forwards
        "fields_unlisted": {},  # backend -> tensor fields its table does not list (checked by the rule)
        "fields_not_checked": {},  # backend -> {field: why} for the tensors a metadata object showed and not checked
        "builds_in_graph": 0,  # builds that returned inside a capture (not recorded: no host copy during capture)
        "draft_refreshes": 0,  # eager update_draft_decode_metadata calls that became their metadata's reference
        "draft_refreshes_in_graph": 0,  # ... called inside a capture (the refreshed fields are the graph's)
        "captures_refreshed_in_graph": {},  # kind -> captures whose metadata was refreshed inside them
        "spec_layout": None,  # V2 spec-decode layout of the vLLM that loaded the plugin (source_check.spec_layout)
        "spec_layout_known": None,  # is it one of KNOWN_SPEC_LAYOUTS (None: not looked at, the probe is off)
        "sched_calls": 0,  # get_scheduler_metadata calls (fa3 hooks installed)
        "sched_sm_margin": 0,  # ... that received the injected sm_margin
        "fwd_sm_margin": 0,  # torch.ops._vllm_fa3_C.fwd calls that received it
        "poison_calls": 0,  # scheduler-metadata buffers poisoned
        "entries_poisoned": 0,  # entries filled over all of them
        "runner": None,  # module.Class of the model runner seen on a capture's call stack
        # the self control (REPRO_INJECT, repro.vllm_integration.inject): what it wrote and whether it reached
        "captures_injected": {},  # kind -> captures whose attention forwards read buffers the injection wrote
        "injected_forwards": 0,  # eager draft-capture forwards that ran right after an injection
    }


COUNTERS: dict[str, Any] = new_counters()


def snapshot() -> dict[str, Any]:
    """The counters as they are now (the auditor's check and view counts folded in)."""
    out = copy.deepcopy(COUNTERS)
    out["checks"], out["views_checked"] = AUDITOR.checks, AUDITOR.views
    out["installed"] = sorted(_installed)
    return out


def _bump(name: str, key: str | None = None, n: int = 1) -> None:
    bump(COUNTERS, name, key, n)


def _views(md: Any, spec: BackendFields = FLASH_ATTN) -> dict[str, Any]:
    """The tensors of a metadata object the auditor compares, by field path (backend_fields.tensor_fields); what the
    backend's table does not list, or a tensor that is not checked, is noted in the counters."""
    views, skipped = tensor_fields(md, spec)
    new = [p for p in unlisted(views, spec) if p not in COUNTERS["fields_unlisted"].get(spec.name, [])]
    if new:
        COUNTERS["fields_unlisted"][spec.name] = sorted({*COUNTERS["fields_unlisted"].get(spec.name, []), *new})
    if skipped:
        COUNTERS["fields_not_checked"].setdefault(spec.name, {}).update(skipped)
    return views


def _num_reqs(md: Any) -> int | None:
    qsl = getattr(md, "query_start_loc", None)
    if qsl is not None and hasattr(qsl, "shape"):
        return qsl.shape[0] - 1
    parts = [getattr(md, k, None) for k in ("num_decodes", "num_prefills")]  # FlashInfer
    if all(isinstance(p, int) for p in parts):
        return sum(parts)
    seq = getattr(md, "seq_lens", None)
    return seq.shape[0] if seq is not None and hasattr(seq, "shape") else None


def _shape(md: Any) -> dict[str, Any]:
    return {
        "num_reqs": _num_reqs(md),
        "max_query_len": getattr(md, "max_query_len", 1),
        "max_seq_len": getattr(md, "max_seq_len", 1 << 30),
        # a per-request tensor of causal flags names no one layout: the decoding of FA3's fields assumes causal
        "causal": causal if isinstance(causal := getattr(md, "causal", True), bool) else True,
    }


def _label(md: Any) -> str:
    s = _shape(md)
    return f"t{getattr(md, 'num_actual_tokens', '?')}r{s['num_reqs']}"


def _emit(obj: dict, tag: str = AUDIT_TAG) -> None:
    emit(tag, obj)  # the structured channel (repro.channel); a tagged line when the process has none


# --- CUDA graph captures and their kind ---------------------------------------------------------------------------


@dataclass
class _Capture:
    kind: str
    forwards: int = 0
    # id -> (metadata object its attention forwards used, its backend's table)
    metadata: dict[int, tuple[Any, BackendFields]] = field(default_factory=dict)
    refreshed: set[int] = field(default_factory=set)  # ids of the metadata refreshed in place inside this capture
    injected: bool = False  # an attention forward of this capture read buffers the self control wrote


_CAPTURES: list[_Capture] = []
_BUILD_DEPTH = [0]  # wrapped builds under way (one engine thread builds metadata)
_AUDIT_ON = {"on": False}


def graph_kind(frame: Any, depth: int = 40) -> str:
    """The kind of the CUDA graph a capture records, from the vLLM objects on its call stack: the graph manager
    (a `self` whose class name has CudaGraphManager), the attribute its owner keeps it under (prefill_cudagraph_manager,
    decode_cudagraph_manager, cudagraph_manager), the progress-bar text vLLM passes (`desc`, `progress_bar_desc`) and
    whether a speculator (a spec_decode module, a Speculator/Eagle/Drafter/Proposer class) is on the stack. Also
    records the model runner's class. UNKNOWN_KIND when nothing on the stack says."""
    mgr, attr, texts, draft, seen_vllm = None, None, [], False, False
    f = frame
    for _ in range(depth):
        if f is None:
            break
        mod = str(f.f_globals.get("__name__", ""))
        seen_vllm = seen_vllm or mod.startswith("vllm")
        loc = f.f_locals
        obj = loc.get("self")
        cls = type(obj).__name__ if obj is not None else ""
        if is_draft_frame(f):
            draft = True
        for k in ("progress_bar_desc", "desc"):
            if isinstance(loc.get(k), str):
                texts.append(loc[k])
        if cls.endswith("ModelRunner") and COUNTERS["runner"] is None:
            COUNTERS["runner"] = f"{type(obj).__module__}.{cls}"
        if obj is not None and mgr is None and "CudaGraphManager" in cls:
            mgr = obj
        elif obj is not None and mgr is not None and attr is None and obj is not mgr:
            try:
                attr = next((k for k, v in vars(obj).items() if v is mgr), None)
            except TypeError:
                pass
        f = f.f_back
    if mgr is None and not texts and not seen_vllm:
        return UNKNOWN_KIND
    words = [w.lower() for w in (attr or "", *texts, type(mgr).__name__ if mgr is not None else "")]
    phase = next((p for w in words for p in ("prefill", "decode", "mixed") if p in w), None)
    if draft:
        return f"draft {phase}" if phase in ("prefill", "decode") else f"draft ({UNKNOWN_KIND})"
    if mgr is None and not texts:
        return UNKNOWN_KIND
    return f"target {phase}" if phase else f"target ({UNKNOWN_KIND})"


def install_capture_tracker(cuda: Any) -> None:
    """Wrap torch.cuda.graph (`cuda` is torch.cuda, or a stand-in): count every capture by kind, collect the
    attention metadata its forwards use, and audit that metadata when the capture ends."""
    orig = cuda.graph
    if getattr(orig, "_repro_tracked", False):
        return

    class graph(orig):  # type: ignore[misc,valid-type]
        _repro_tracked = True

        def __enter__(self):
            _CAPTURES.append(_Capture(graph_kind(sys._getframe(1))))
            if "on" in _INJECTOR:  # before recording starts: nothing the injection writes is in the graph
                _INJECTOR["on"].capture_begins(_CAPTURES[-1].kind)
            try:
                return super().__enter__()
            except BaseException:
                _finish_capture(_CAPTURES.pop(), failed=True)
                raise

        def __exit__(self, *exc: Any):
            try:
                return super().__exit__(*exc)
            finally:
                _finish_capture(_CAPTURES.pop(), failed=exc[0] is not None)
                if "on" in _INJECTOR:
                    _INJECTOR["on"].new_pass()

    graph.__name__, graph.__qualname__, graph.__doc__ = orig.__name__, orig.__qualname__, orig.__doc__
    cuda.graph = graph


def _finish_capture(cap: _Capture, failed: bool) -> None:
    _bump("captures", cap.kind)
    if cap.forwards:
        _bump("captures_with_attention", cap.kind)
    if cap.injected and not failed:
        _bump("captures_injected", cap.kind)
    if failed or not _AUDIT_ON["on"]:
        return
    known = [(md, spec) for key, (md, spec) in cap.metadata.items() if AUDITOR.knows(key)]
    if cap.refreshed:
        _bump("captures_refreshed_in_graph", cap.kind)
    stale = False
    for md, spec in known:
        views = _views(md, spec)
        # a field an in-graph refresh rewrote holds what the graph will compute at replay, not what the build wrote
        skip = {p for p in views if spec.refreshed(p)} if id(md) in cap.refreshed else set()
        for m in AUDITOR.check(id(md), views, skip):
            stale = True
            _emit({"stale": m.to_dict(), "message": str(m), "capture": cap.kind})
    if known:
        _bump("captures_audited", cap.kind)
    if stale:
        _bump("captures_stale", cap.kind)


def _wrap_forward(impl_cls: Any, spec: BackendFields = FLASH_ATTN) -> None:
    """Count every <X>Impl.forward (per backend; FLASH_ATTN's also by FA version); with the auditor on, check the
    metadata of every eager forward, and hand a capture's metadata to that capture."""
    if getattr(impl_cls.forward, "_repro_wrapped", False):
        return
    orig_forward = impl_cls.forward

    @functools.wraps(orig_forward)
    def forward(
        self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any, *a: Any, **k: Any
    ):
        _bump("attention_forwards")
        _bump("backends", spec.name)
        if spec.name == FLASH_ATTN.name:
            version = getattr(self, "vllm_flash_attn_version", None)
            _bump("fa_versions", str(version) if version is not None else "unknown")
        injector = _INJECTOR.get("on")
        if _CAPTURES:
            cap = _CAPTURES[-1]
            cap.forwards += 1
            if attn_metadata is not None:
                cap.metadata.setdefault(id(attn_metadata), (attn_metadata, spec))
                if injector is not None and not cap.injected:
                    cap.injected = injector.reached(tensor_fields(attn_metadata, spec)[0])
        elif injector is not None and attn_metadata is not None and not _capturing():
            if capture_role(sys._getframe(1)) == "draft":  # a draft capture's eager warmup pass
                if injector.inject(id(attn_metadata), tensor_fields(attn_metadata, spec)[0], "draft warmup"):
                    _bump("injected_forwards")
        if not _CAPTURES and _AUDIT_ON["on"] and attn_metadata is not None and not _capturing():
            for m in AUDITOR.check(id(attn_metadata), _views(attn_metadata, spec)):
                _emit({"stale": m.to_dict(), "message": str(m)})
        return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **k)

    forward._repro_wrapped = True  # type: ignore[attr-defined]
    impl_cls.forward = forward


def _classes(module: Any, spec: BackendFields) -> tuple[Any, Any] | None:
    """The backend's builder and impl classes, or None after an error line saying what is missing."""
    try:
        return find_classes(module, spec)
    except LookupError as e:
        _emit({"error": f"attention backend {spec.name}: {e}"}, PLUGIN_TAG)
        return None


def install_probe(module: Any, cuda: Any = None, spec: BackendFields = FLASH_ATTN) -> bool:
    """The coverage counters on an attention backend module (and torch.cuda, or a stand-in). False (and an error
    line) when the backend's classes are not there."""
    found = _classes(module, spec)
    if found is None:
        return False
    impl_cls = found[1]
    if cuda is None:
        import torch

        cuda = torch.cuda
    if getattr(cuda, "graph", None) is None:
        _emit({"error": "torch.cuda.graph not found: CUDA graph captures cannot be counted"}, PLUGIN_TAG)
        return False
    _wrap_forward(impl_cls, spec)
    install_capture_tracker(cuda)
    COUNTERS["backends"].setdefault(spec.name, 0)
    _installed.add("probe")
    return True


def _record(builder: Any, md: Any, spec: BackendFields) -> None:
    """What a build's metadata shows, recorded; a build that returns inside a capture is counted, not copied."""
    if md is None:
        return
    if _CAPTURES or _capturing():
        _bump("builds_in_graph")
        return
    AUDITOR.record_build(id(md), _label(md), _views(md, spec), _build_shape(builder, md))


def _build_shape(builder: Any, md: Any) -> dict[str, Any]:
    """What a build's metadata was built for (its shape, and the builder's head dim): what decodes its FA3 layout."""
    return {**_shape(md), "head_dim": getattr(builder, "headdim", 128)}


def _wrap_builder(builder_cls: Any, spec: BackendFields) -> list[str]:
    """Record every build (build, and build_for_cudagraph_capture, which may change what build wrote: TRITON_ATTN
    fills seq_lens with 1); follow every update_draft_decode_metadata. Returns the methods wrapped."""
    done = []
    for name in ("build", "build_for_cudagraph_capture"):
        orig = getattr(builder_cls, name, None)
        if orig is None or getattr(orig, "_repro_wrapped", False):
            continue

        def recorded(self: Any, *args: Any, _orig: Any = orig, **kwargs: Any) -> Any:
            _BUILD_DEPTH[0] += 1
            try:
                md = _orig(self, *args, **kwargs)
            finally:
                _BUILD_DEPTH[0] -= 1
            # a build called by another (build_for_cudagraph_capture -> build): the outer one counts
            if _BUILD_DEPTH[0]:
                return md
            if _AUDIT_ON["on"]:
                _record(self, md, spec)
            if "on" in _INJECTOR:  # after the auditor recorded what the build wrote
                _after_build(self, md, spec)
            return md

        functools.update_wrapper(recorded, orig)
        recorded._repro_wrapped = True  # type: ignore[attr-defined]
        setattr(builder_cls, name, recorded)
        done.append(name)
    orig_update = getattr(builder_cls, "update_draft_decode_metadata", None)
    if orig_update is not None and not getattr(orig_update, "_repro_wrapped", False):

        @functools.wraps(orig_update)
        def update_draft_decode_metadata(self: Any, metadata: Any, *args: Any, **kwargs: Any) -> Any:
            out = orig_update(self, metadata, *args, **kwargs)
            _refreshed(metadata, spec)
            return out

        update_draft_decode_metadata._repro_wrapped = True  # type: ignore[attr-defined]
        builder_cls.update_draft_decode_metadata = update_draft_decode_metadata
        done.append("update_draft_decode_metadata")
    return done


def _after_build(builder: Any, md: Any, spec: BackendFields) -> None:
    """The self control after a metadata build (outside any graph): a build in the target's capture leaves its
    buffers' contents behind; a build in a draft capture gets them written over its own."""
    if md is None or _CAPTURES or _capturing():
        return
    injector = _INJECTOR["on"]
    role = capture_role(sys._getframe(2))
    if role == "target":
        if injector.target_built(_label(md), tensor_fields(md, spec)[0]):
            sched = getattr(md, "scheduler_metadata", None)
            if sched is not None and hasattr(sched, "numel"):
                injector.fill_padding(layout_of(_build_shape(builder, md), sched.numel()), POISON_FILL)
    elif role == "draft":
        injector.new_pass()
        injector.inject(id(md), tensor_fields(md, spec)[0], "draft build")


POISON_FILL = "int-max"  # what the self control leaves in the scheduler-metadata entries FA3 never writes


def install_inject(module: Any, cuda: Any = None, spec: BackendFields = FLASH_ATTN, source: str = SOURCES[0]) -> bool:
    """The self control (repro.vllm_integration.inject) on an attention backend module (and torch.cuda, or a
    stand-in): the builder's builds and the impl's forwards wrapped, the capture tracker installed. False, with an
    error line, when the backend's classes are not there."""
    found = _classes(module, spec)
    if found is None:
        return False
    builder_cls, impl_cls = found
    if cuda is None:
        import torch

        cuda = torch.cuda
    if "build" not in _wrap_builder(builder_cls, spec) and not getattr(builder_cls.build, "_repro_wrapped", False):
        _emit({"error": f"attention backend {spec.name}: {builder_cls.__name__}.build not found"}, PLUGIN_TAG)
        return False
    _wrap_forward(impl_cls, spec)
    install_capture_tracker(cuda)
    _INJECTOR["on"] = StaleCaptureInjector(COUNTERS, announce=lambda record: _emit(record, PLUGIN_TAG), keep=source)
    _installed.add("inject")
    return True


def _refreshed(md: Any, spec: BackendFields) -> None:
    """After vLLM refreshed a metadata object in place: inside a capture, its refreshed fields become the graph's
    to compute (marked on the capture, nothing copied); outside, what it shows now is its new reference."""
    if md is None:
        return
    if _CAPTURES or _capturing():
        _bump("draft_refreshes_in_graph")
        if _CAPTURES:
            _CAPTURES[-1].refreshed.add(id(md))
        return
    if AUDITOR.refresh(id(md), _views(md, spec)):
        _bump("draft_refreshes")


def install(module: Any, cuda: Any = None, spec: BackendFields = FLASH_ATTN) -> bool:
    """Install the freshness auditor on an attention backend module (passed in so tests can hand it a stand-in).
    False, with a REPRO_PLUGIN error line, when the backend's classes are not there."""
    found = _classes(module, spec)
    if found is None:
        return False
    builder_cls, impl_cls = found
    _wrap_builder(builder_cls, spec)
    _wrap_forward(impl_cls, spec)
    if cuda is not None:
        install_capture_tracker(cuda)
    _AUDIT_ON["on"] = True
    _installed.add("audit")
    return True


def spec_layout_of(vllm_root: str | os.PathLike | None) -> tuple[str | None, bool]:
    """(the V2 speculative-decoding layout of the vLLM installed at vllm_root, the folder holding vllm/; whether the
    auditor knows it). Read from the files, never imported (repro.vllm_integration.source_check.spec_layout)."""
    from pathlib import Path

    from repro.vllm_integration.source_check import spec_layout

    layout = spec_layout(Path(vllm_root)) if vllm_root is not None else None
    return layout, layout in KNOWN_SPEC_LAYOUTS


def _installed_vllm_root() -> str | None:
    """The folder holding the vllm package that loaded the plugin (None when it has no files: a stand-in)."""
    vllm = sys.modules.get("vllm")
    paths = list(getattr(vllm, "__path__", None) or [])
    return os.path.dirname(paths[0]) if paths else None


def install_fa3_hooks(module: Any, ops: Any, sm_margin: int = 0, poison: Any = None) -> list[str]:
    """sm_margin and/or poison in vLLM's FA3 calls. `module` is the backend module holding the name
    get_scheduler_metadata (vLLM imports it into flash_attn.py); `ops` is torch.ops._vllm_fa3_C. Returns what it did;
    a hook it could not install is an error line (REPRO_PLUGIN)."""
    done = []
    orig_sched = getattr(module, "get_scheduler_metadata", None)
    if orig_sched is None:
        _emit({"error": f"{module.__name__}: get_scheduler_metadata not found"}, PLUGIN_TAG)
        return done

    @functools.wraps(orig_sched)
    def get_scheduler_metadata(*args: Any, **kwargs: Any):
        _bump("sched_calls")
        if sm_margin:
            kwargs["sm_margin"] = sm_margin
            _bump("sched_sm_margin")
        md = orig_sched(*args, **kwargs)
        if poison is not None and md is not None:
            n = _poison_padding(md, poison, kwargs)
            if n is not None:
                _bump("poison_calls")
                _bump("entries_poisoned", n=n)
        return md

    module.get_scheduler_metadata = get_scheduler_metadata
    done.append(
        "get_scheduler_metadata"
        + (f" sm_margin={sm_margin}" if sm_margin else "")
        + (f" poison={poison.name}" if poison is not None else "")
    )
    if sm_margin:
        fwd = getattr(ops, "fwd", None)
        names = [a.name for a in fwd.default._schema.arguments] if fwd is not None else []
        if "sm_margin" not in names:
            _emit({"error": "torch.ops._vllm_fa3_C.fwd has no sm_margin argument"}, PLUGIN_TAG)
            return done
        idx = names.index("sm_margin")

        def fwd_with_margin(*args: Any, **kwargs: Any):
            if len(args) > idx:
                args = (*args[:idx], sm_margin, *args[idx + 1 :])
            else:
                kwargs["sm_margin"] = sm_margin
            _bump("fwd_sm_margin")
            return fwd(*args, **kwargs)

        ops.fwd = fwd_with_margin
        done.append(f"_vllm_fa3_C.fwd sm_margin={sm_margin} (argument {idx})")
    return done


def _poison_padding(md: Any, poison: Any, kwargs: dict) -> int | None:
    """Fill the never-written entries; how many (None, and an error line, when the layout is not known)."""
    from repro.layout import VLLM, effective_causal, layout_from_size

    window = kwargs.get("window_size") or (-1, -1)
    is_causal, is_local = effective_causal(
        bool(kwargs.get("causal", False)),
        int(window[0]),
        int(kwargs["max_seqlen_q"]),
        int(kwargs["max_seqlen_k"]),
        int(kwargs["headdim"]),
        kwargs.get("page_size") is not None,
    )
    try:
        lay = layout_from_size(VLLM, int(kwargs["batch_size"]), md.numel(), is_causal, is_local)
    except ValueError as e:
        _emit({"error": f"poison: {e}"}, PLUGIN_TAG)
        return None
    return poison.apply(md, lay)


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _write_report() -> None:
    path = os.environ.get(FILE_ENV)
    _emit(
        {
            "summary": AUDITOR.report(),
            "checks": AUDITOR.checks,
            "views": AUDITOR.views,
            "stale": len(AUDITOR.mismatches),
        }
    )
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "checks": AUDITOR.checks,
                    "views": AUDITOR.views,
                    "mismatches": [m.to_dict() for m in AUDITOR.mismatches],
                    "summary": AUDITOR.report(),
                    "counters": snapshot(),
                },
                f,
                indent=1,
            )


def _write_counters() -> None:
    _emit(snapshot(), COUNTERS_TAG)


def requested(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The features the environment asks for, validated (bad values raise ValueError naming the variable)."""
    from repro.poison import parse_poison

    env = os.environ if environ is None else environ
    out: dict[str, Any] = {"audit": env.get(ENV) == "1"}
    out["probe"] = out["audit"] or env.get(PROBE_ENV) == "1"
    margin = env.get(SM_MARGIN_ENV, "0") or "0"
    try:
        out["sm_margin"] = int(margin)
    except ValueError:
        raise ValueError(f"{SM_MARGIN_ENV}={margin!r}: expected a whole number of SMs") from None
    if out["sm_margin"] < 0:
        raise ValueError(f"{SM_MARGIN_ENV}={margin!r}: must not be negative")
    out["poison"] = parse_poison(env.get(POISON_ENV))
    weights = env.get(WEIGHTS_ENV, "") or DUMMY
    if weights not in (*WEIGHTS, DUMMY):
        raise ValueError(f"{WEIGHTS_ENV}={weights!r}: expected {', '.join(WEIGHTS)} or {DUMMY}")
    out["weights"] = None if weights == DUMMY else weights
    source = env.get(INJECT_SOURCE_ENV, "") or SOURCES[0]
    if source not in SOURCES:
        raise ValueError(f"{INJECT_SOURCE_ENV}={source!r}: expected {' or '.join(SOURCES)}")
    out["inject_source"] = source
    backend = env.get(BACKEND_ENV, "") or DEFAULT_BACKEND
    if not backend.replace("_", "").isalnum() or backend.upper() != backend:
        raise ValueError(f"{BACKEND_ENV}={backend!r}: expected a vLLM attention backend name such as FLASH_ATTN")
    out["attention_backend"] = backend
    inject = env.get(INJECT_ENV, "")
    if inject and inject not in INJECTIONS:
        raise ValueError(f"{INJECT_ENV}={inject!r}: expected {' or '.join(INJECTIONS)}")
    out["inject"] = inject or None
    return out


def register() -> None:
    """vLLM calls this in every process it starts (general plugins). A feature is announced as installed only when
    every hook it needs went in; otherwise its error line says what was missing."""
    try:
        want = requested()
    except Exception as e:  # a bad variable must be visible, not silently ignored
        _emit({"error": str(e)}, PLUGIN_TAG)
        return
    if not (want["probe"] or want["sm_margin"] or want["poison"] or want["weights"] or want["inject"]):
        return
    needs_backend = want["probe"] and "probe" not in _installed or want["audit"] and "audit" not in _installed
    if needs_backend or want["inject"] and "inject" not in _installed:
        import importlib

        try:
            spec = backend_for(want["attention_backend"])
            backend = importlib.import_module(spec.module)
        except (ImportError, KeyError) as e:
            _emit({"error": f"cannot import vLLM's attention backend {want['attention_backend']}: {e}"}, PLUGIN_TAG)
            return
        COUNTERS["spec_layout"], COUNTERS["spec_layout_known"] = spec_layout_of(_installed_vllm_root())
        if want["probe"] and "probe" not in _installed:
            if install_probe(backend, spec=spec):
                atexit.register(_write_counters)
                _emit({"installed": "probe", "backend": spec.name}, PLUGIN_TAG)
        if want["audit"] and "audit" not in _installed:
            if install(backend, spec=spec):
                atexit.register(_write_report)
                _emit({"installed": "audit", "backend": spec.name}, PLUGIN_TAG)
        if want["inject"] and "inject" not in _installed:
            if install_inject(backend, spec=spec, source=want["inject_source"]):
                _emit({"installed": "inject", "injection": want["inject"], "backend": spec.name}, PLUGIN_TAG)
    if (want["sm_margin"] or want["poison"]) and "fa3" not in _installed:
        import torch
        from vllm.v1.attention.backends import flash_attn

        try:
            import vllm.vllm_flash_attn._vllm_fa3_C  # noqa: F401  registers torch.ops._vllm_fa3_C
        except ImportError as e:
            _emit({"error": f"vLLM's FA3 library does not import: {e}"}, PLUGIN_TAG)
            return
        done = install_fa3_hooks(flash_attn, torch.ops._vllm_fa3_C, want["sm_margin"], want["poison"])
        expected = 1 + bool(want["sm_margin"])
        if len(done) == expected:
            _installed.add("fa3")
            _emit({"installed": "fa3", "hooks": done}, PLUGIN_TAG)
    if want["weights"] and "weights" not in _installed:
        from vllm.model_executor.model_loader import dummy_loader

        loader = getattr(dummy_loader, "DummyModelLoader", None)
        if loader is None or not callable(getattr(loader, "load_weights", None)):
            _emit({"error": f"{dummy_loader.__name__}: DummyModelLoader.load_weights not found"}, PLUGIN_TAG)
            return
        install_weights(loader, want["weights"], lambda record: _emit(record, PLUGIN_TAG))
        _installed.add("weights")
        _emit({"installed": "weights", "weights": want["weights"]}, PLUGIN_TAG)
