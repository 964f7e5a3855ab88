"""The capture tracker: torch.cuda.graph wrapped, so that every CUDA graph capture is counted under its graph kind
(target decode, target mixed, draft prefill, draft decode, read from the vLLM objects on the capture's call stack;
UNKNOWN_KIND when none says), the attention metadata its forwards used is collected and, with the auditor on,
checked when the capture ends (what the graph baked in). Holds the capture bookkeeping the backend hooks share
(_CAPTURES, the captures open now; _AUDIT_ON; _INJECTOR, the self control's injector when one is installed) and
`capturing()`, whether a graph is being captured on the current stream."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Any

from repro.contract.channel import emit
from repro.contract.tags import AUDIT_TAG
from repro.errors import StaleCapture
from repro.vllm_integration.plugin import counters, refresh
from repro.vllm_integration.plugin.audit import CaptureDescriptor
from repro.vllm_integration.plugin.backend_fields import BackendFields
from repro.vllm_integration.plugin.identity import ByIdentity
from repro.vllm_integration.plugin.inject import StaleCaptureInjector, is_draft_frame
from repro.vllm_integration.plugin.metadata_views import fields_of, views_of
from repro.vllm_integration.plugin.replay import ReplayChecker, guarded

UNKNOWN_KIND = "unknown kind"
# A draft decode graph runs the draft steps after the first; each but the last advances seq_lens by one in place
# (vLLM's update_draft_inputs). vLLM's num_speculative_tokens stays far below this bound (the gate runs 3).
MAX_DRAFT_LOOP_ADVANCE = 8


@dataclass
class _Capture:
    kind: str
    forwards: int = 0
    # each metadata object its attention forwards used -> (it, its backend's table)
    metadata: ByIdentity[tuple[Any, BackendFields]] = field(default_factory=ByIdentity)
    # metadata refreshed in place inside this capture -> the builder that refreshed it (judged at the capture's end)
    refreshed: ByIdentity[Any] = field(default_factory=ByIdentity)
    injected: bool = False  # an attention forward of this capture read buffers the self control wrote
    manager: str = UNKNOWN_KIND  # the capture manager recording it, and whose it is (manager_of)
    # the FULL descriptor this capture records (capture_descriptor: (descriptor, None), (None, why it is unreadable),
    # or (None, None) outside a FULL capture pass)
    descriptor: tuple[CaptureDescriptor | None, str | None] = (None, None)
    graph: Any = None  # the torch.cuda.CUDAGraph it records (the replay check knows its replays by it)


_CAPTURES: list[_Capture] = []
_AUDIT_ON = {"on": False, "strict": False, "refresh": True}  # refresh: the refresh judged (the request's judge_refresh)
_INJECTOR: dict[str, StaleCaptureInjector] = {}  # "on" -> the injector, when the request asked for one
_REPLAY: dict[str, ReplayChecker] = {}  # "on" -> the replay check, where torch has the global replay hook


def judging_refresh() -> bool:
    """Is every draft-decode refresh judged (plugin.refresh)? The request's judge_refresh, on unless it says off."""
    return bool(_AUDIT_ON.get("refresh", True))


def graph_kind(frame: Any, depth: int = 40) -> str:
    """The kind of the CUDA graph a capture records, from the vLLM objects on its call stack: the graph manager
    (a `self` whose class name has CudaGraphManager), the attribute its owner keeps it under (prefill_cudagraph_manager,
    decode_cudagraph_manager, cudagraph_manager), the progress-bar text vLLM passes (`desc`, `progress_bar_desc`) and
    whether a speculator (a spec_decode module, a Speculator/Eagle/Drafter/Proposer class) is on the stack. Also
    records the model runner's class. UNKNOWN_KIND when nothing on the stack says."""
    mgr, attr, texts, draft, seen_vllm, runner_seen = None, None, [], False, False, False
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
        if cls.endswith("ModelRunner") and not runner_seen:
            runner_seen = True
            if counters.COUNTERS["runner"] is None:
                counters.COUNTERS["runner"] = f"{type(obj).__module__}.{cls}"
            _record_method(obj)
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
    phase = next((p for w in words for p in ("prefill", "decode", "mixed", "query") if p in w), None)
    if draft:  # query: DFlash's parallel-drafting graph (query_cudagraph_manager)
        return f"draft {phase}" if phase in ("prefill", "decode", "query") else f"draft ({UNKNOWN_KIND})"
    if mgr is None and not texts:
        return UNKNOWN_KIND
    return f"target {phase}" if phase else f"target ({UNKNOWN_KIND})"


def _record_method(runner: Any) -> None:
    """The speculative method the model runner's config resolved to and its speculator's class (counters'
    speculative_method, speculator): what vLLM ran, for a check against what was asked. None where it has neither."""
    spec = getattr(runner, "speculative_config", None)
    if spec is None:
        spec = getattr(getattr(runner, "vllm_config", None), "speculative_config", None)
    method = getattr(spec, "method", None)
    counters.COUNTERS["speculative_method"] = str(method) if method is not None else None
    if method is not None:  # every engine's of this process (`LLM` twice, one method each): captures per method
        counters.bump("speculative_methods", str(method))
    speculator = getattr(runner, "speculator", None) or getattr(runner, "drafter", None)
    counters.COUNTERS["speculator"] = type(speculator).__name__ if speculator is not None else None


def manager_of(frame: Any, depth: int = 40) -> str:
    """The capture manager recording a graph and whose it is, from the call stack: `<manager class>.<attribute> of
    <owner class>` (SpeculatorCudaGraphManager.prefill_cudagraph_manager of StandaloneARSpeculator,
    DFlashCudaGraphManager.query_cudagraph_manager of DFlashSpeculator, CudaGraphManager.cudagraph_manager of
    GPUModelRunner): each speculative method's captures, per capture manager. UNKNOWN_KIND when no manager is on it."""
    mgr, owner, attr = None, None, None
    f = frame
    for _ in range(depth):
        if f is None:
            break
        obj = f.f_locals.get("self")
        if obj is not None and mgr is None and "CudaGraphManager" in type(obj).__name__:
            mgr = obj
        elif obj is not None and mgr is not None and owner is None and obj is not mgr:
            try:
                attr = next((k for k, v in vars(obj).items() if v is mgr), None)
            except TypeError:
                attr = None
            owner = obj if attr is not None else None
        f = f.f_back
    if mgr is None:
        return UNKNOWN_KIND
    where = f".{attr} of {type(owner).__name__}" if owner is not None else ""
    return f"{type(mgr).__name__}{where}"


def draft_on_stack(frame: Any, depth: int = 40) -> bool:
    """Is a speculator frame on the call stack (an eager draft step, whose loop may have advanced seq_lens)?"""
    f = frame
    for _ in range(depth):
        if f is None:
            return False
        if is_draft_frame(f):
            return True
        f = f.f_back
    return False


def install_capture_tracker(cuda: Any) -> None:
    """Wrap torch.cuda.graph (`cuda` is torch.cuda, or a stand-in): count every capture by kind, collect the
    attention metadata its forwards use, and audit that metadata when the capture ends."""
    orig = cuda.graph
    if getattr(orig, "_repro_tracked", False):
        return

    class graph(orig):  # type: ignore[misc,valid-type]
        _repro_tracked = True

        def __enter__(self):
            frame = sys._getframe(1)
            if _AUDIT_ON["on"]:  # a fork child's first capture: its start mark (the parent's is not its own)
                counters.mark_started(os.environ.get(counters.STARTED_ENV))
            _CAPTURES.append(
                _Capture(graph_kind(frame), manager=manager_of(frame), descriptor=capture_descriptor(frame))
            )
            _CAPTURES[-1].graph = getattr(self, "cuda_graph", None)
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
    counters.bump("captures", cap.kind)
    counters.bump("captures_by_manager", cap.manager)
    if cap.forwards:
        counters.bump("captures_with_attention", cap.kind)
        counters.bump("full_captures_by_manager", cap.manager)
        if cap.descriptor[0] is not None and cap.descriptor[0].spec_tokens is not None:  # a K-specialized graph
            counters.bump("captures_by_k", str(cap.descriptor[0].spec_tokens))
    if cap.injected and not failed:
        counters.bump("captures_injected", cap.kind)
        counters.bump("injected_by_manager", cap.manager)
    if failed or not _AUDIT_ON["on"]:
        return
    auditor = counters.AUDITOR
    known = [(md, spec) for md, spec in cap.metadata.values() if auditor.knows(md)]
    if cap.refreshed:
        counters.bump("captures_refreshed_in_graph", cap.kind)
    stale = False
    for md, spec in known:
        views = views_of(md, spec)
        skip = _refreshed_fields(cap, md, spec, views)
        advance = MAX_DRAFT_LOOP_ADVANCE if cap.kind.startswith("draft decode") else 0
        found = auditor.check(md, views, skip, advance)
        if md in cap.refreshed and not judging_refresh():
            refresh.not_judged(counters.COUNTERS, spec, views)
        elif md in cap.refreshed:  # what the refresh computed: the builder's answer for the step the views show
            found += refresh.judge(auditor, counters.COUNTERS, cap.refreshed.get(md), md, spec, views)
        for m in found:
            stale = True
            emit(AUDIT_TAG, {"stale": m.to_dict(), "message": str(m), "capture": cap.kind})
    for md, spec in cap.metadata.values():  # every metadata the graph baked in, built for the descriptor captured?
        skip = _refreshed_fields(cap, md, spec, views_of(md, spec))
        stale = audit_descriptor(md, spec, cap.descriptor, cap.kind, skip) or stale
    desc = cap.descriptor[0]
    if "on" in _REPLAY and cap.kind.startswith("draft") and desc is not None and cap.metadata:  # a FULL draft graph
        views = {p: v for md, spec in cap.metadata.values() for p, v in views_of(md, spec).items()}
        guarded(
            counters.COUNTERS,
            "a capture's end",
            _REPLAY["on"].captured,
            cap.graph,
            f"{cap.kind} {desc.label}",
            desc,
            views,
        )
    if known:
        counters.bump("captures_audited", cap.kind)
        counters.bump("audited_by_manager", cap.manager)
    if stale:
        counters.bump("captures_stale", cap.kind)
        counters.bump("stale_by_manager", cap.manager)
    if cap.forwards or known:  # what a FULL capture checked, on disk for a SIGKILL after it: at once while the
        # process found nothing (a small report, under a millisecond), else rate-limited (its first finding is written)
        counters.keep_snapshot(f"a FULL capture ({cap.kind}) by {cap.manager}", now=not counters.AUDITOR.mismatches)
    if stale:
        stop_if_strict(cap)


def stop_if_strict(cap: _Capture) -> None:
    """Under `repro audit --strict` (_AUDIT_ON's strict): this process's reports written now, then StaleCapture
    raised in the capture that was stale, which ends vLLM's engine (a bisect step needs no more than the first)."""
    if not _AUDIT_ON.get("strict"):
        return
    counters.report_now()
    raise StaleCapture(f"strict audit: the {cap.kind} capture of {cap.manager} baked in stale attention metadata")


SINGLE_FORWARD_DRAFT = "draft query"  # DFlash's query graph (graph_kind): one forward per block, no draft loop


def _refreshed_fields(cap: _Capture, md: Any, spec: BackendFields, views: dict[str, Any]) -> set[str]:
    """The fields of md an in-graph refresh of this capture rewrote: they hold what the graph will compute at replay,
    not what the build wrote, so the capture-end contents and descriptor checks skip them; what the refresh itself
    computed is judged instead (refresh.judge, against the builder), the draft loop's step fields are the loop's.
    Only for metadata refreshed inside this capture.
    DFlash's query graph refreshes scheduler_metadata (update_draft_decode_metadata) but runs no draft loop, so the
    loop's step fields (seq_lens, slot_mapping) stay checked there (vLLM 0.34 dflash/speculator.py
    _prepare_graph_forward); any other capture, its kind known or not, may run the loop."""
    if md not in cap.refreshed:
        return set()
    loop = not cap.kind.startswith(SINGLE_FORWARD_DRAFT)
    return {p for p in views if spec.refreshed(p, draft_loop=loop)}


def _manager_desc(frame: Any, depth: int) -> tuple[Any, Any]:
    """(the capture manager, its loop's batch descriptor) of the nearest CudaGraphManager.capture frame holding a
    `desc` with a cg_mode (the loop of vLLM's capture, 0.20-0.34), or (None, None)."""
    f = frame
    for _ in range(depth):
        if f is None:
            break
        obj, desc = f.f_locals.get("self"), f.f_locals.get("desc")
        if f.f_code.co_name == "capture" and "CudaGraphManager" in type(obj).__name__ and hasattr(desc, "cg_mode"):
            return obj, desc
        f = f.f_back
    return None, None


def capture_descriptor(frame: Any, depth: int = 60) -> tuple[CaptureDescriptor | None, str | None]:
    """The FULL batch descriptor the capture manager on the call stack is capturing (its warmup or captured pass):
    (descriptor, None); (None, why) for a FULL descriptor the check cannot read (no token count, microbatches);
    (None, None) outside every FULL capture pass (no manager on the stack, or a PIECEWISE descriptor). A descriptor
    without num_reqs takes the manager's rule for it (min(num_tokens, max_num_reqs), vLLM 0.26-0.34)."""
    mgr, desc = _manager_desc(frame, depth)
    mode = str(getattr(getattr(desc, "cg_mode", None), "name", getattr(desc, "cg_mode", None)))
    if desc is None or mode != "FULL":
        return None, None
    tokens, reqs = getattr(desc, "num_tokens", None), getattr(desc, "num_reqs", None)
    if not isinstance(tokens, int):
        return None, f"a FULL descriptor without a token count ({type(desc).__name__})"
    if (getattr(desc, "num_ubatches", 1) or 1) > 1:
        return None, f"a FULL descriptor split into {desc.num_ubatches} microbatches (metadata per microbatch)"
    if not isinstance(reqs, int):
        most = getattr(mgr, "max_num_reqs", None)
        reqs = min(tokens, most) if isinstance(most, int) else None
    uniform = getattr(desc, "uniform_token_count", None)
    longest = getattr(desc, "max_query_len", None)
    query = uniform if isinstance(uniform, int) else longest if isinstance(longest, int) else None
    spec = getattr(desc, "num_speculative_tokens", None)
    return CaptureDescriptor(
        mode, tokens, reqs, query, isinstance(uniform, int), spec if isinstance(spec, int) else None
    ), None


def audit_descriptor(
    md: Any,
    spec: BackendFields,
    where: tuple[CaptureDescriptor | None, str | None],
    kind: str,
    skip: frozenset[str] | set[str] = frozenset(),
) -> bool:
    """The descriptor check (audit.descriptor_mismatches) of one metadata object in a FULL capture pass, `where`
    being capture_descriptor's answer; counted per capture kind when it ran (descriptor_checks), per reason when it
    could not (descriptor_unchecked: the gate cannot vouch), nothing outside a FULL pass. True when it found the
    metadata built for another descriptor (each finding an AUDIT_TAG line, kind stale-descriptor)."""
    desc, why = where
    if desc is None and why is None:
        return False
    found: list = []
    if desc is not None:
        found, why = counters.AUDITOR.check_descriptor(md, desc, fields_of(md), views_of(md, spec), skip)
    if why is not None:
        counters.bump("descriptor_unchecked", f"{kind}: {why}")
        return False
    counters.bump("descriptor_checks", kind)
    if desc is not None and desc.spec_tokens is not None:  # a K-specialized graph (plugin.dynamic_k)
        counters.bump("descriptor_checks_by_k", str(desc.spec_tokens))
    for m in found:
        emit(AUDIT_TAG, {"stale": m.to_dict(), "message": str(m), "capture": kind})
    if found:
        counters.bump("descriptor_stale", kind)
    return bool(found)


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (False without torch or CUDA)."""
    try:
        import torch  # inside the try: no torch (or no CUDA) means nothing is being captured

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False
