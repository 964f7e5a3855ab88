"""The self control: the capture defect of vLLM 0.21.0-0.25.1 re-created inside the build under test
(a request's inject=stale-capture, installed by repro.vllm_integration.plugin).

What those releases did: the draft model's FULL CUDA-graph capture ran (its eager warmup pass and its captured pass)
on attention metadata whose views point into persistent buffers (query_start_loc, seq_lens, FA3's scheduler
metadata) that held the contents of another batch descriptor (the target's last capture build). The injection
re-creates that state and nothing else. Whose contents (the request's inject_source, REPRO_INJECT_SOURCE in the
gate's environment): by default the target's FIRST capture build (its largest descriptor); `last` gives the last one, what 0.21.0-0.25.1 left. On the H200 the last build's
contents (t4r1) left 0.26.0's kernels in bounds at 132 SMs and under MPS (missed in plain and mps:16:
results/h200-selfcontrol-fidelity), the first build's made every mode fault (results/h200-agree-selfcontrol):

- the first (or every, for `last`) metadata build inside the TARGET's CudaGraphManager.capture leaves a device copy
  of the whole persistent buffers behind its views (the fields repro.vllm_integration.plugin.backend_fields checks);
- inside a DRAFT CudaGraphManager.capture (a speculator on the call stack), right after each of its metadata builds
  (a fixed release builds fresh metadata for every pass), before the first eager attention forward of each pass on
  metadata it did not build (a release that reuses saved metadata), and as a captured pass begins (before
  torch.cuda.graph starts recording, so nothing of it is in the graph), those buffers are written back with that
  copy. Same engine, kernels and SM configuration; replay untouched (the runtime build rewrites the buffers).

Where a release refreshes the draft's metadata inside its graphs (0.28+: the captured pass rewrites those buffers
for its own batch, which heals a write before recording), the defect's other half is re-created too: the object.
0.21.0-0.25.1 handed the draft's capture a metadata OBJECT built for another descriptor (the target's attn_states),
so its scalars (token and request counts, max lengths) and view sizes were another batch's. Inside a draft FULL
capture, every pass's metadata build returns the object the same graph manager built first for that graph mode and
pass (warmup or captured; 0.20-0.25 build once per descriptor for both passes: the first such build serves
both): its largest descriptor's, as the source mutant `bisect stale-draft-capture` does (`reuse`, counted in
inject_reused). Fixed releases (0.26.0) take both; the buffers alone already fault there.

Every speculative method's capture is reached the same way (repro.vllm_integration.gate.methods): the hook points
are the attention builder's builds inside any `*CudaGraphManager.capture` with a speculator on the stack, and the
pass that `create_forward_fn(desc, warmup)` names. In vLLM 0.26-0.34 that is SpeculatorCudaGraphManager for EAGLE,
EAGLE3 and MTP (TargetDependentARSpeculator: the target's attention groups where it can reuse them) and draft_model
(StandaloneARSpeculator, 0.34.0: the draft's own buffers, builders and slot-mapping buffer, given the target's
contents field by field), and DFlashCudaGraphManager (_prepare_dflash_inputs_to_capture, the DFlash family); which
manager each write reached is counted (inject_builds_by_manager, and injected_by_manager at capture end).

It writes buffers and tells nobody: the auditor compares what the views show with what their build wrote, and the
kernels read what they read. Its counters say whether it reached the draft's FULL captures (`captures_injected`): a
self control it never reached is no control (the gate cannot vouch)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from repro.vllm_integration.plugin.identity import ByIdentity

STALE_CAPTURE = "stale-capture"
# the second form (StaleDescriptorInjector): a draft FULL pass gets metadata built for another descriptor of the same
# capture list, its object and its buffers' contents together (consistent with each other: only a check against the
# descriptor being captured sees it)
STALE_DESCRIPTOR = "stale-descriptor"
INJECTIONS = (STALE_CAPTURE, STALE_DESCRIPTOR)  # the gate's self-control forms, every build, every mode
# the third form (repro.vllm_integration.plugin.refresh, StaleRefreshInjector): every draft-decode refresh computes
# for a step far ahead (refresh.FAR tokens); a request may ask for it (python -m repro plugin-request --inject), the
# gate's default forms leave it out (only a build with update_draft_decode_metadata has something for it to change)
STALE_REFRESH = "stale-refresh"
# the fourth (repro.vllm_integration.plugin.dynamic_k, StaleKInjector): a K-specialized draft FULL pass gets another
# K's metadata of the same batch shape; the gate runs it for its dynamic-K methods (gate/dynamic_k.py)
STALE_K = "stale-k"
ALL_INJECTIONS = (*INJECTIONS, STALE_REFRESH, STALE_K)
# which of the target's capture builds the draft's buffers are given: its last (what 0.21.0-0.25.1 left in them), or
# its first (the largest batch descriptor: the contents furthest from any draft descriptor's)
SOURCES = ("first", "last")
# the views of the defect (vLLM PR #48261): per-request offsets, sequence lengths, FA3's AOT scheduler metadata; the
# KV-cache addressing (block table, slot mapping) is not part of it
INJECTED_FIELDS = ("query_start_loc", "seq_lens", "scheduler_metadata")
MAX_BUFFER_BYTES = 64 << 20  # a view into a larger allocation is not a metadata buffer: not copied
DRAFT_WORDS = ("Speculator", "Eagle", "Drafter", "Proposer")


def bump(counters: dict[str, Any], name: str, key: str | None = None, n: int = 1) -> None:
    """Add n to a counter, or to one key of a counter that counts per key (the plugin's counters use it too)."""
    if key is None:
        counters[name] = counters.get(name, 0) + n
    else:
        d = counters.setdefault(name, {})
        d[key] = d.get(key, 0) + n


def is_draft_frame(frame: Any) -> bool:
    """A frame of the speculator: a spec_decode module, or a method of a Speculator/Eagle/Drafter/Proposer class."""
    mod = str(frame.f_globals.get("__name__", ""))
    obj = frame.f_locals.get("self")
    cls = type(obj).__name__ if obj is not None else ""
    return "spec_decode" in mod or any(w in cls for w in DRAFT_WORDS)


def capture_role(frame: Any, depth: int = 60) -> str | None:
    """'draft' or 'target' when the call stack is inside a CudaGraphManager's capture (a `capture` method of a class
    named *CudaGraphManager*), by whether a speculator frame is on it; None outside every capture."""
    in_capture, draft = False, False
    f = frame
    for _ in range(depth):
        if f is None:
            break
        obj = f.f_locals.get("self")
        if f.f_code.co_name == "capture" and obj is not None and "CudaGraphManager" in type(obj).__name__:
            in_capture = True
        draft = draft or is_draft_frame(f)
        f = f.f_back
    if not in_capture:
        return None
    return "draft" if draft else "target"


# a capture pass's warmup flag: True (the eager warmup pass), False (the captured pass), BOTH (one build serves both)
BOTH = None
PASS_NAMES = {True: "warmup", False: "capture", BOTH: "both"}


# where a draft build's pass is (capture_pass): (the graph manager capturing, the descriptor's graph mode, warmup)
Pass = tuple[Any, str, bool | None]


def label_of_pass(where: Pass) -> str:
    """How a capture pass reads in a record: its graph mode and pass."""
    kind = {True: "warmup pass", False: "captured pass", BOTH: "warmup and captured passes"}[where[2]]
    return f"{where[1]} {kind}: the first descriptor's metadata"


def _mode_name(desc: Any) -> str:
    """A batch descriptor's graph mode by name (FULL, PIECEWISE)."""
    return str(getattr(desc.cg_mode, "name", desc.cg_mode))


def capture_pass(frame: Any, depth: int = 60) -> Pass | None:
    """(the graph manager, the batch descriptor's graph mode, warmup) of the capture pass a metadata build is
    for, under a CudaGraphManager's capture: a frame with `desc` (its cg_mode) and `warmup` locals (create_forward_fn
    (desc, warmup), 0.26-0.33: one build per pass), or else the nearest create_forward_fn frame with `desc` alone
    (create_forward_fn(desc), 0.20-0.25: one build for the warmup and the captured pass, BOTH); None when the stack
    says neither (a `desc` anywhere else, the capture loop's own included, places nothing)."""
    mode, warmup, mgr, desc_only = None, None, None, None
    f = frame
    for _ in range(depth):
        if f is None:
            break
        loc = f.f_locals
        desc = loc.get("desc")
        if mode is None and isinstance(loc.get("warmup"), bool) and hasattr(desc, "cg_mode"):
            mode, warmup = _mode_name(desc), loc["warmup"]
        if desc_only is None and f.f_code.co_name == "create_forward_fn" and hasattr(desc, "cg_mode"):
            desc_only = _mode_name(desc)
        obj = loc.get("self")
        if (
            mgr is None
            and f.f_code.co_name == "capture"
            and obj is not None
            and "CudaGraphManager" in type(obj).__name__
        ):
            mgr = obj
        f = f.f_back
    if mgr is None or (mode is None and desc_only is None):
        return None
    if mode is None:
        return mgr, desc_only, BOTH
    return mgr, mode, bool(warmup)


def _storage_bytes(t: Any) -> Any:
    """A uint8 tensor over the whole storage behind a tensor (the persistent buffer a view points into)."""
    import torch  # only inside vLLM's process: the CPU tier's stand-ins hand real tensors too

    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@dataclass
class StaleCaptureInjector:
    """Holds the target's last capture contents and writes them into the draft's capture buffers (see the module)."""

    counters: dict[str, Any]
    # called with a record at the first write of each kind (draft build, draft warmup, capture begins), right away:
    # a case that faults or hangs after it still says that the injection ran
    announce: Callable[[dict], None] = lambda record: None
    keep: str = "first"  # SOURCES: which target capture build's contents are written
    snapshots: dict[str, Any] = field(default_factory=dict)  # field path -> bytes of its whole buffer
    source: str | None = None  # descriptor label of the target build the snapshots hold
    last: list[tuple[Any, Any, int]] = field(default_factory=list)  # (destination bytes, snapshot, n) of the last write
    injected: set[int] = field(default_factory=set)  # every storage pointer the injection ever wrote
    done: ByIdentity[None] = field(default_factory=ByIdentity)  # metadata objects injected in the current pass
    # builder -> graph manager -> (graph mode, warmup) -> what _first kept of the metadata it built first for that pass
    # (by identity, never by id(): a new builder or manager at a dead one's address inherits nothing)
    first_built: ByIdentity[ByIdentity[dict[tuple[str, bool | None], Any]]] = field(default_factory=ByIdentity)
    reused: ByIdentity[None] = field(default_factory=ByIdentity)  # metadata handed to a later pass than their own

    def _bump(self, name: str, key: str | None = None, n: int = 1) -> None:
        bump(self.counters, name, key, n)

    def target_built(self, label: str, views: dict[str, Any]) -> bool:
        """A build inside the target's capture returned (outside any graph): copy the whole buffers behind its views
        (the defect's fields, INJECTED_FIELDS). True when something was copied; with keep="first", only the first
        build of the target's capture is copied."""
        if self.keep == "first" and self.snapshots:
            return False
        snaps = {}
        for path, t in views.items():
            if t is None or not hasattr(t, "untyped_storage") or path.rsplit(".", 1)[-1] not in INJECTED_FIELDS:
                continue
            src = _storage_bytes(t)
            if src.numel() > MAX_BUFFER_BYTES:
                self._bump("inject_skipped_large", path)
                continue
            snaps[path] = src.clone()
        if snaps:
            self.snapshots, self.source = snaps, label
            self._bump("inject_snapshots")
        return bool(snaps)

    def fill_padding(self, layout: Any, poison_name: str) -> None:
        """In the copy of FA3's scheduler metadata, the entries FA3 never writes (which vLLM copies into its buffer as
        FA3 left them: leftover memory, what made the real defect fault) get a fixed fill (repro.case.poison), so the self
        control does not depend on leftover memory either. A layout repro.backends.layout does not know: left as copied."""
        import torch  # torch inside vLLM's process only: the gate's parent imports this module

        from repro.case.poison import parse_poison  # only for the self control's fill

        snap = self.snapshots.get("scheduler_metadata")
        if snap is None or layout is None:
            return
        ints = snap[: snap.numel() // 4 * 4].view(torch.int32)[: layout.size]
        self._bump("inject_padding_filled", n=parse_poison(poison_name).apply(ints, layout))

    def new_pass(self) -> None:
        """A capture began or ended, or metadata was built: the next pass's metadata is injected again."""
        self.done.clear()

    def inject(self, md: Any, views: dict[str, Any], when: str) -> bool:
        """Write the target capture contents kept (target_built) into the buffers behind these (draft) views of the
        metadata md; False when there is nothing to write (no target capture seen, or no field in common)."""
        if md in self.done:
            return True
        self.done.add(md)
        if not self.snapshots:
            self._bump("inject_no_source", when)
            return False
        writes, seen = [], set()
        for path, t in views.items():
            snap = self.snapshots.get(path)
            if snap is None or t is None or not hasattr(t, "untyped_storage"):
                continue
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                continue
            seen.add(ptr)
            dst = _storage_bytes(t)
            n = min(dst.numel(), snap.numel())
            writes.append((dst, snap, n))
            self._bump("inject_fields", path)
        if not writes:
            self._bump("inject_no_source", when)
            return False
        self._write(writes)
        self.last = writes
        self._wrote(when, views)
        return True

    def _wrote(self, when: str, views: dict[str, Any]) -> None:
        self._bump("inject_writes", when)
        if self.counters["inject_writes"][when] == 1:
            self.announce({"injection_wrote": when, "source": self.source, "fields": sorted(views)})

    def _write(self, writes: list[tuple[Any, Any, int]]) -> None:
        for dst, snap, n in writes:
            dst[:n].copy_(snap[:n])
            self.injected.add(dst.untyped_storage().data_ptr())
            self._bump("inject_bytes", n=n)

    def capture_begins(self, kind: str) -> None:
        """Before a draft capture starts recording: the buffers of the last injection written again (a release that
        builds nothing between its warmup and captured passes reuses the same buffers)."""
        self.new_pass()
        if not kind.startswith("draft"):
            self.last = []  # a target capture: what the draft's last pass was given is not this pass's
        elif self.last:
            self._write(self.last)
            self._wrote("capture begins", {})

    def replaces(self, md: Any, where: Pass | None) -> bool:
        """Is md, a draft capture's build for the pass `where` (capture_pass's answer), one the object half replaces:
        built (not None), in a pass the stack places (None: counted in inject_reuse_unplaced) and a FULL one?"""
        if md is None:
            return False
        if where is None:
            self._bump("inject_reuse_unplaced")
            return False
        return where[1] == "FULL"

    def _first(self, builder: Any, where: Pass, kept: Callable[[], Any]) -> Any:
        """What is kept of the first metadata this builder built for the same graph manager, graph mode and pass:
        kept() on that first build."""
        per_pass = self.first_built.setdefault(builder, ByIdentity()).setdefault(where[0], {})
        if where[1:] not in per_pass:
            per_pass[where[1:]] = kept()
        return per_pass[where[1:]]

    def reuse(self, builder: Any, md: Any, where: Pass | None) -> Any:
        """A draft capture's build returned md: for a FULL pass, the metadata this builder built first for the same
        graph manager, graph mode and pass (warmup or captured) instead, kept on the first build (see the module).
        `where` is capture_pass's answer; None (the stack does not say which pass) leaves md as built."""
        if not self.replaces(md, where):
            return md
        first = self._first(builder, where, lambda: md)
        if first is md:
            return md
        self.reused.add(first)
        self._bump("inject_reused", PASS_NAMES[where[2]])
        if sum(self.counters["inject_reused"].values()) == 1:
            self.announce({"injection_wrote": "draft metadata reused", "source": label_of_pass(where)})
        return first

    def reached(self, views: dict[str, Any], md: Any = None) -> bool:
        """Do these views point into a buffer the injection wrote, or is this metadata (md) one it reused?"""
        if md is not None and md in self.reused:
            return True
        return any(
            t is not None and hasattr(t, "untyped_storage") and t.untyped_storage().data_ptr() in self.injected
            for t in views.values()
        )


@dataclass
class StaleDescriptorInjector(StaleCaptureInjector):
    """The self control's second form (inject=stale-descriptor): inside a draft FULL capture, every pass's
    metadata build returns the object the same builder built first for that graph manager, graph mode and pass (its
    largest descriptor's, as `reuse` does) AND the whole buffers behind that object's views get back the contents
    its own build wrote (kept when it was built, every tensor field: the defect's views, block table, slot mapping).
    Object and buffers are then one consistent build for another descriptor of the same capture list: what a release
    whose capture builds each descriptor's metadata for the wrong descriptor does. The auditor's contents check sees
    nothing wrong in it; only its descriptor check (audit.descriptor_mismatches) does. Counted in inject_rebuilt;
    nothing is taken from the target's captures."""

    # first_built keeps (the first metadata, [(its view, its whole buffer's bytes)]) for each pass

    def target_built(self, label: str, views: dict[str, Any]) -> bool:
        return False  # this form takes nothing from the target's captures

    def inject(self, md: Any, views: dict[str, Any], when: str) -> bool:
        return False  # a draft warmup forward is given nothing more: other_descriptor wrote after the build

    def other_descriptor(self, builder: Any, md: Any, views: dict[str, Any], where: Pass | None) -> Any:
        """A draft capture's build returned md (its views `views`): for a FULL pass, the first metadata of the same
        builder, manager, graph mode and pass instead, its buffers given back what its build wrote; the first build
        of each pass is kept (copied) and returned as built. `where`: capture_pass's answer (None: left as built)."""
        if not self.replaces(md, where):
            return md
        first, copies = self._first(builder, where, lambda: (md, self._copies(views)))
        if first is md:
            self.last = []  # this pass runs on its own build: nothing to write again as its capture begins
            return md
        writes = [(_storage_bytes(view), snap, snap.numel()) for view, snap in copies]
        self._write(writes)
        self.last = writes
        self.reused.add(first)
        self._bump("inject_rebuilt", PASS_NAMES[where[2]])
        if sum(self.counters["inject_rebuilt"].values()) == 1:
            self.announce({"injection_wrote": "draft metadata of another descriptor", "source": label_of_pass(where)})
        return first

    def _copies(self, views: dict[str, Any]) -> list[tuple[Any, Any]]:
        """(view, a copy of the whole buffer behind it) for every tensor view, one per buffer; a view into an
        allocation over MAX_BUFFER_BYTES is not a metadata buffer (counted in inject_skipped_large, left alone)."""
        out, seen = [], set()
        for path, t in views.items():
            if t is None or not hasattr(t, "untyped_storage") or t.untyped_storage().data_ptr() in seen:
                continue
            seen.add(t.untyped_storage().data_ptr())
            src = _storage_bytes(t)
            if src.numel() > MAX_BUFFER_BYTES:
                self._bump("inject_skipped_large", path)
                continue
            out.append((t, src.clone()))
        return out

    def capture_begins(self, kind: str) -> None:
        """Before a draft capture starts recording: the last pass's buffers written again (what happened between
        its build and the recording is undone); a target capture forgets them."""
        self.new_pass()
        if not kind.startswith("draft"):
            self.last = []
        elif self.last:
            self._write(self.last)
            self._bump("inject_writes", "capture begins")


def make_injector(form: str, counters: dict[str, Any], announce: Callable[[dict], None], keep: str) -> Any:
    """The self control's injector for a form of INJECTIONS (the request's inject)."""
    if form == STALE_DESCRIPTOR:
        return StaleDescriptorInjector(counters, announce=announce, keep=keep)
    return StaleCaptureInjector(counters, announce=announce, keep=keep)
