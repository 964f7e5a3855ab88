"""The hooks on an attention backend's classes (found by backend_fields): <X>MetadataBuilder.build and
build_for_cudagraph_capture (what every build's metadata shows, recorded for the freshness auditor; the self
control's injection after a build), update_draft_decode_metadata (judged by repro.vllm_integration.plugin.refresh:
an eager refresh against its builder's answer right away, then the metadata's new reference; one inside a capture at
the capture's end; the self control's form stale-refresh after it) and <X>Impl.forward (counted; an eager forward's metadata
checked, a captured one's handed to its capture). Installed as the auditor (install), the coverage counters
(install_probe) or the self control (install_inject)."""

from __future__ import annotations

import functools
import sys
from typing import Any

from repro.contract.channel import emit
from repro.contract.tags import AUDIT_TAG, PLUGIN_TAG
from repro.vllm_integration.plugin import capture, counters, dynamic_k, refresh, replay
from repro.vllm_integration.plugin.audit import layout_of
from repro.vllm_integration.plugin.backend_fields import FLASH_ATTN, BackendFields, find_classes, tensor_fields
from repro.vllm_integration.plugin.inject import (
    SOURCES,
    STALE_CAPTURE,
    STALE_K,
    STALE_REFRESH,
    StaleDescriptorInjector,
    capture_pass,
    capture_role,
    make_injector,
)
from repro.vllm_integration.plugin.metadata_views import build_shape, label_of, views_of

POISON_FILL = "int-max"  # what the self control leaves in the scheduler-metadata entries FA3 never writes
_BUILD_DEPTH = [0]  # wrapped builds under way (one engine thread builds metadata)


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
        counters.bump("attention_forwards")
        counters.bump("backends", spec.name)
        if spec.name == FLASH_ATTN.name:
            version = getattr(self, "vllm_flash_attn_version", None)
            counters.bump("fa_versions", str(version) if version is not None else "unknown")
        injector = capture._INJECTOR.get("on")
        if capture._CAPTURES:
            cap = capture._CAPTURES[-1]
            cap.forwards += 1
            if attn_metadata is not None:
                cap.metadata.setdefault(attn_metadata, (attn_metadata, spec))
                if injector is not None and not cap.injected:
                    cap.injected = injector.reached(tensor_fields(attn_metadata, spec)[0], attn_metadata)
        elif injector is not None and attn_metadata is not None and not capture.capturing():
            if capture_role(sys._getframe(1)) == "draft":  # a draft capture's eager warmup pass
                if injector.inject(attn_metadata, tensor_fields(attn_metadata, spec)[0], "draft warmup"):
                    counters.bump("injected_forwards")
        if not capture._CAPTURES and capture._AUDIT_ON["on"] and attn_metadata is not None and not capture.capturing():
            frame = sys._getframe(1)
            advance = capture.MAX_DRAFT_LOOP_ADVANCE if capture.draft_on_stack(frame) else 0
            for m in counters.AUDITOR.check(attn_metadata, views_of(attn_metadata, spec), advance=advance):
                emit(AUDIT_TAG, {"stale": m.to_dict(), "message": str(m)})
            where = capture.capture_descriptor(frame)  # a FULL capture's eager warmup pass: (None, None) elsewhere
            if where != (None, None):
                capture.audit_descriptor(attn_metadata, spec, where, capture.graph_kind(frame))
            counters.keep_snapshot("an eager forward's check")  # at once after a stale finding, else rate-limited
        return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **k)

    forward._repro_wrapped = True  # type: ignore[attr-defined]
    impl_cls.forward = forward


def _classes(module: Any, spec: BackendFields) -> tuple[Any, Any] | None:
    """The backend's builder and impl classes, or None after an error line saying what is missing."""
    try:
        return find_classes(module, spec)
    except LookupError as e:
        emit(PLUGIN_TAG, {"error": f"attention backend {spec.name}: {e}"})
        return None


def install_probe(module: Any, cuda: Any = None, spec: BackendFields = FLASH_ATTN) -> bool:
    """The coverage counters on an attention backend module (and torch.cuda, or a stand-in). False (and an error
    line) when the backend's classes are not there."""
    found = _classes(module, spec)
    if found is None:
        return False
    impl_cls = found[1]
    if cuda is None:
        import torch  # the real torch.cuda only when no stand-in is handed in (the CPU tier hands one)

        cuda = torch.cuda
    if getattr(cuda, "graph", None) is None:
        emit(PLUGIN_TAG, {"error": "torch.cuda.graph not found: CUDA graph captures cannot be counted"})
        return False
    _wrap_forward(impl_cls, spec)
    capture.install_capture_tracker(cuda)
    counters.COUNTERS["backends"].setdefault(spec.name, 0)
    counters._installed.add("probe")
    return True


def _record(builder: Any, md: Any, spec: BackendFields) -> None:
    """What a build's metadata shows, recorded; a build that returns inside a capture is counted, not copied."""
    if md is None:
        return
    if capture._CAPTURES or capture.capturing():
        counters.bump("builds_in_graph")
        return
    shape = build_shape(builder, md) | dynamic_k.build_k(sys._getframe(2))  # the K of a K-specialized pass
    views = views_of(md, spec)
    counters.AUDITOR.record_build(md, label_of(md), views, shape)
    if "on" in capture._REPLAY:  # the speculator's runtime builds of the batch under way, for the replay check
        frame = sys._getframe(2)

        def kept() -> None:
            draft = capture.draft_on_stack(frame) and replay.runtime(frame)
            capture._REPLAY["on"].built(label_of(md), views, shape, draft)

        replay.guarded(counters.COUNTERS, "a build", kept)


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
            if capture._AUDIT_ON["on"]:
                _record(self, md, spec)
            if "on" in capture._INJECTOR:  # after the auditor recorded what the build wrote
                md = _after_build(self, md, spec)
            return md

        functools.update_wrapper(recorded, orig)
        recorded._repro_wrapped = True  # type: ignore[attr-defined]
        setattr(builder_cls, name, recorded)
        done.append(name)
    orig_update = getattr(builder_cls, "update_draft_decode_metadata", None)
    if orig_update is not None and not getattr(orig_update, "_repro_wrapped", False):

        @functools.wraps(orig_update)
        def update_draft_decode_metadata(self: Any, metadata: Any, *args: Any, **kwargs: Any) -> Any:
            busy = bool(capture._CAPTURES) or capture.capturing()
            judged = metadata is not None and capture._AUDIT_ON["on"] and capture.judging_refresh()
            with refresh.InputWatch(self, spec, judged) as watch:  # what it hands FA3 (in a capture: which tensors)
                out = orig_update(self, metadata, *args, **kwargs)
            injector = capture._INJECTOR.get("on")
            if isinstance(injector, refresh.StaleRefreshInjector) and metadata is not None:  # before it is judged
                injector.after_refresh(self, metadata, spec, tensor_fields(metadata, spec)[0], busy)
            _refreshed(self, metadata, spec, watch.calls)
            return out

        update_draft_decode_metadata._repro_wrapped = True  # type: ignore[attr-defined]
        builder_cls.update_draft_decode_metadata = update_draft_decode_metadata
        done.append("update_draft_decode_metadata")
    return done


def _after_build(builder: Any, md: Any, spec: BackendFields) -> Any:
    """The self control after a metadata build (outside any graph); returns the metadata the caller gets. A build in
    the target's capture leaves its buffers' contents behind; a build in a draft capture gets them written over its
    own, and a draft FULL pass gets the metadata its graph manager built first for that pass (inject.reuse)."""
    if md is None or capture._CAPTURES or capture.capturing():
        return md
    injector = capture._INJECTOR["on"]
    role = capture_role(sys._getframe(2))
    if role == "target":
        if injector.target_built(label_of(md), tensor_fields(md, spec)[0]):
            sched = getattr(md, "scheduler_metadata", None)
            if sched is not None and hasattr(sched, "numel"):
                injector.fill_padding(layout_of(build_shape(builder, md), sched.numel()), POISON_FILL)
    elif role == "draft" and isinstance(injector, dynamic_k.StaleKInjector):  # the form stale-k: another K's
        md = injector.other_k(builder, md, capture_pass(sys._getframe(2)), sys._getframe(2))
    elif role == "draft" and isinstance(injector, StaleDescriptorInjector):  # the second form: another descriptor's
        counters.bump("inject_builds_by_manager", capture.manager_of(sys._getframe(2)))
        injector.new_pass()
        md = injector.other_descriptor(builder, md, tensor_fields(md, spec)[0], capture_pass(sys._getframe(2)))
    elif role == "draft":  # any speculator's capture manager (capture.manager_of names it: per method)
        counters.bump("inject_builds_by_manager", capture.manager_of(sys._getframe(2)))
        injector.new_pass()
        injector.inject(md, tensor_fields(md, spec)[0], "draft build")
        md = injector.reuse(builder, md, capture_pass(sys._getframe(2)))
    return md


def install_inject(
    module: Any,
    cuda: Any = None,
    spec: BackendFields = FLASH_ATTN,
    source: str = SOURCES[0],
    form: str = STALE_CAPTURE,
) -> bool:
    """The self control (repro.vllm_integration.plugin.inject) in the form `form` (INJECTIONS) on an attention
    backend module (and torch.cuda, or a stand-in): the builder's builds and the impl's forwards wrapped, the capture
    tracker installed. False, with an error line, when the backend's classes are not there."""
    found = _classes(module, spec)
    if found is None:
        return False
    builder_cls, impl_cls = found
    if cuda is None:
        import torch  # the real torch.cuda only when no stand-in is handed in (the CPU tier hands one)

        cuda = torch.cuda
    if "build" not in _wrap_builder(builder_cls, spec) and not getattr(builder_cls.build, "_repro_wrapped", False):
        emit(PLUGIN_TAG, {"error": f"attention backend {spec.name}: {builder_cls.__name__}.build not found"})
        return False
    _wrap_forward(impl_cls, spec)
    capture.install_capture_tracker(cuda)
    announce = lambda record: emit(PLUGIN_TAG, record)  # noqa: E731
    if form == STALE_REFRESH:
        capture._INJECTOR["on"] = refresh.make_refresh_injector(counters.COUNTERS, announce)
    elif form == STALE_K:
        capture._INJECTOR["on"] = dynamic_k.StaleKInjector(counters.COUNTERS, announce)
    else:
        capture._INJECTOR["on"] = make_injector(form, counters.COUNTERS, announce, source)
    counters._installed.add("inject")
    return True


def _refreshed(builder: Any, md: Any, spec: BackendFields, calls: list[dict] | None = None) -> None:
    """After vLLM refreshed a metadata object in place: inside a capture, marked on the capture with its builder
    (judged at the capture's end, nothing copied now); outside, with the auditor on, what it computed judged against
    the builder's answer for this step (refresh.judge: each finding an AUDIT_TAG line, kind stale-refresh), then what
    it shows is its new reference."""
    if md is None:
        return
    if capture._CAPTURES or capture.capturing():
        counters.bump("draft_refreshes_in_graph")
        if capture._CAPTURES:
            capture._CAPTURES[-1].refreshed[md] = builder
        if capture._AUDIT_ON["on"] and capture.judging_refresh():  # which tensors it handed FA3: no copy in a capture
            refresh.judge_inputs_in_capture(counters.COUNTERS, md, spec, calls or [])
        return
    if not capture._AUDIT_ON["on"] or not counters.AUDITOR.knows(md):
        return
    views = views_of(md, spec)
    if not capture.judging_refresh():
        refresh.not_judged(counters.COUNTERS, spec, views)
    found = []
    if capture.judging_refresh():
        found = refresh.judge(counters.AUDITOR, counters.COUNTERS, builder, md, spec, views)
        found += refresh.judge_inputs(counters.AUDITOR, counters.COUNTERS, md, spec, calls or [], not found)
    for m in found:
        emit(AUDIT_TAG, {"stale": m.to_dict(), "message": str(m), "capture": "eager draft refresh"})
    if counters.AUDITOR.refresh(md, views):
        counters.bump("draft_refreshes")
    counters.keep_snapshot("a draft refresh judged")  # at once after a stale-refresh, else rate-limited


def install(
    module: Any,
    cuda: Any = None,
    spec: BackendFields = FLASH_ATTN,
    judge_refresh: bool = True,
    check_replay: bool = True,
) -> bool:
    """Install the freshness auditor on an attention backend module (passed in so tests can hand it a stand-in), with
    the refresh judged (plugin.refresh) and the replay check (plugin.replay) unless the request turned them off.
    False, with a REPRO_PLUGIN error line, when the backend's classes are not there."""
    found = _classes(module, spec)
    if found is None:
        return False
    builder_cls, impl_cls = found
    _wrap_builder(builder_cls, spec)
    _wrap_forward(impl_cls, spec)
    if cuda is not None:
        capture.install_capture_tracker(cuda)
    capture._AUDIT_ON["refresh"] = judge_refresh
    counters.COUNTERS["refresh_judging"] = "on" if judge_refresh else refresh.OFF
    _install_replay_check(cuda, check_replay)
    capture._AUDIT_ON["on"] = True
    counters._installed.add("audit")
    return True


def _install_replay_check(cuda: Any, asked: bool = True) -> None:
    """The replay check (plugin.replay) where torch has the global replay-start hook and the request asks for it;
    off, and said so in the counters (replay_check: why), where not."""
    if not asked:
        counters.COUNTERS["replay_check"] = replay.OFF
        return
    if cuda is None:
        import torch  # the real torch.cuda only when no stand-in is handed in (vLLM's process; the CPU tier hands one)

        cuda = torch.cuda
    register, why = replay.hook_of(cuda)
    counters.COUNTERS["replay_check"] = why or "on"
    if register is None or "on" in capture._REPLAY:
        return
    checker = capture._REPLAY["on"] = replay.ReplayChecker(counters.COUNTERS)

    def replayed(graph: Any) -> None:
        for m in replay.guarded(counters.COUNTERS, "a replay", checker.on_replay, graph, default=[]):
            counters.AUDITOR.mismatches.append(m)
            emit(AUDIT_TAG, {"stale": m.to_dict(), "message": str(m), "capture": "replay"})
        counters.keep_snapshot("a replay")  # at once after a stale-replay, else rate-limited

    register(replayed)
