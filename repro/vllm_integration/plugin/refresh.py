"""The draft-decode refresh judged, never trusted: vLLM's update_draft_decode_metadata (0.28 on) rewrites a draft's
metadata in place between draft steps, eagerly or recorded inside the fused draft graph (FLASH_ATTN recomputes FA3's
scheduler_metadata from the views' query_start_loc and seq_lens; TRITON_ATTN's and FLASHINFER's are no-ops in
0.34.0). After each eager refresh, and at the end of a capture whose metadata was refreshed inside it, every field
the refresh computes is compared with what the build's own builder gives for that draft step: the step's batch (the
request count and query_start_loc the views show) and its seq_lens (advanced by the draft loop to this step, as the
views show them when the refresh runs), in the entries that belong to that batch only: FA3 writes the first b of
each round_up(b, 4)-entry vector and leaves the rest as its allocation found them, so entries past the batch (and
the tile-count semaphore, the kernels' own) are counted (refresh_entries_unjudged), never compared. A refresh that
disagrees in the batch's own entries computed for another step or batch: a Mismatch of kind stale-refresh. Only then
does what the views show become the metadata's new reference (audit.refresh). A request may ask for no judging
(PluginRequest.judge_refresh false): each refreshed field is then counted in refresh_unjudged, and refresh_judging
says why.

What each backend's refresh computes and how the builder gives it (REFRESHES), by field path: a field the backend's
table says its refresh rewrites (backend_fields.refreshed_in_graph, other than the draft loop's own step fields)
without a rule here, or a builder without the method the rule calls, is counted in refresh_unjudged and left out:
the gate cannot vouch for it, and says so.

The self control's form stale-refresh (StaleRefreshInjector): after every refresh of a draft's metadata, the fields
it computes are computed again by the same builder for another step of the sequence, FAR tokens ahead (seq_lens +
FAR), and written into the same views; inside a capture those writes are recorded into the graph, so every replay
computes for that step. The step is far ahead rather than one back (as the source mutant `refresh-previous-step`,
scripts/mutate_vllm.py, computes) because FA3's scheduler metadata depends on seq_lens only through each request's
KV block count (ceil(seqlen_k / kBlockN), kBlockN 128-192): a one-token shift changes it only where a sequence
crosses a block, which the gate's short sequences rarely do (results/h100-dynamic-sleep-0.34.0: every eager refresh
rewritten for the previous step, none changed in a batch's own entries). FAR tokens ahead, every request's block count
differs, so num_splits_dynamic differs for every request whose own split count is below the metadata's cap
(max_num_splits: the gate's short sequences); it never exceeds that cap, which the forward's buffers are sized for
(shifting down instead could leave FA3's prepare kernel a block count of 0 to divide by). inject_refresh_changed
counts the eager refreshes it changed in a batch's own entries: a control with none re-created no defect, and the gate
cannot vouch for it (gate.coverage.recreated_nothing)."""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from repro.backends.layout import round_up
from repro.vllm_integration.plugin.audit import STALE_REFRESH, FreshnessAuditor, Mismatch, _ints
from repro.vllm_integration.plugin.backend_fields import DRAFT_STEP, BackendFields
from repro.vllm_integration.plugin.identity import ByIdentity
from repro.vllm_integration.plugin.inject import Pass, StaleCaptureInjector, bump

# a rule: (the builder, the metadata, `back`: how many tokens before the step its views show the answer is for; 0
# that step's own, negative a step ahead) -> what the builder gives for the field; None when the builder cannot say (it
# lacks the method vLLM's refresh calls)
Rule = Callable[[Any, Any, int], Any]

# The self control's shift, in tokens ahead: the refresh computed for another step of the sequence, far enough that
# FA3's block counts (a block of 128-192 tokens) differ for every request.
FAR = 4096


def _step_seq_lens(md: Any, back: int) -> Any:
    """The views' seq_lens `back` tokens before the step they show (negative: ahead), never below 0."""
    seq = md.seq_lens
    return seq if not back else (seq - back).clamp(min=0)


def _fa3_scheduler_metadata(builder: Any, md: Any, back: int = 0) -> Any:
    """FlashAttentionMetadataBuilder.update_draft_decode_metadata's computation (vLLM 0.28-0.34, flash_attn.py):
    _get_scheduler_metadata for the views' batch (num_decode_reqs, else one request per seq_lens entry) and seq_lens,
    with the metadata's own max lengths, causality and split cap."""
    get = getattr(builder, "_get_scheduler_metadata", None)
    if get is None:
        return None
    seq = _step_seq_lens(md, back)
    return get(
        aot_schedule=True,
        batch_size=getattr(md, "num_decode_reqs", None) or seq.shape[0],
        cu_query_lens=md.query_start_loc,
        max_query_len=md.max_query_len,
        seqlens=seq,
        max_seq_len=md.max_seq_len,
        causal=md.causal,
        max_num_splits=getattr(md, "max_num_splits", 0),
    )


def _fa3_batch_entries(md: Any, size: int) -> list[int] | None:
    """The flat indices of FA3's scheduler metadata that belong to the refreshed batch of b requests: every vector of
    it (prepare_seqlen_q, num_splits_dynamic, num_m_blocks, varlen_batch_idx, num_nheads_in_l2: which depends on the
    FA3 build and the batch, repro.backends.layout) holds round_up(b, 4) entries, of which FA3 writes the first b;
    the tile-count semaphore follows the vectors (FA3's prepare kernel zeroes it, its attention kernels count on it).
    Entries [b, round_up(b, 4)) of each vector are never written: get_scheduler_metadata returns them as its
    allocation left them (torch::empty), so two correct computations for the same step differ there. None when the
    size fits no such layout (then nothing of the field is judged)."""
    b = getattr(md, "num_decode_reqs", None) or _step_seq_lens(md, 0).shape[0]
    rounded = round_up(b, 4)
    if not b or size % rounded not in (0, 1):  # vectors of round_up(b, 4) entries, then the semaphore (or none)
        return None
    return [v * rounded + i for v in range(size // rounded) for i in range(b)]


@dataclass(frozen=True)
class Refresh:
    """How a backend's refresh computes one field: `compute` (the builder's answer for a step, Rule) and `entries`
    (the flat indices of the field that belong to the refreshed batch, given its size; None: no layout known)."""

    compute: Rule
    entries: Callable[[Any, int], list[int] | None]


REFRESHES: dict[str, dict[str, Refresh]] = {
    "FLASH_ATTN": {"scheduler_metadata": Refresh(_fa3_scheduler_metadata, _fa3_batch_entries)}
}
OFF = "off: the request asks for no refresh judging (judge_refresh false)"


def computed_fields(spec: BackendFields, views: dict[str, Any]) -> list[str]:
    """The views a backend's refresh computes (its table's refreshed_in_graph, the draft loop's step fields aside)."""
    return [
        p
        for p in views
        if any(fnmatch.fnmatchcase(p, pat) and why != DRAFT_STEP for pat, why in spec.refreshed_in_graph.items())
    ]


def judge(
    auditor: FreshnessAuditor,
    counters: dict[str, Any],
    builder: Any,
    md: Any,
    spec: BackendFields,
    views: dict[str, Any],
) -> list[Mismatch]:
    """Every field the refresh of md computed, against what `builder` gives for the step the views show now, entry by
    entry over the entries that belong to the refreshed batch (Refresh.entries; a length that differs is another
    batch's too); the mismatches (kind stale-refresh) are kept by the auditor and returned. Counted: refresh_checks
    (fields compared), refresh_stale, refresh_unjudged (backend.field: no rule, the builder lacks its method, or no
    layout known for its size), refresh_entries_unjudged (backend.field -> entries past the batch, never compared:
    neither clean nor stale); a rule that raised is unjudged with the exception's type. Copies to the host: never call
    it while a graph is being captured."""
    found: list[Mismatch] = []
    for path in computed_fields(spec, views):
        if views.get(path) is None:
            continue  # the refresh wrote nothing there (vLLM's returns early without scheduler metadata)
        rule = REFRESHES.get(spec.name, {}).get(path)
        try:  # the builder's answer: a build whose method takes other arguments must not stop vLLM's draft loop
            want = rule.compute(builder, md, 0) if rule is not None else None
            now = _ints(views[path])
            entries = rule.entries(md, len(now)) if want is not None else None
        except Exception as e:  # noqa: BLE001  counted unjudged (the gate cannot vouch for the field), never raised
            bump(counters, "refresh_unjudged", f"{spec.name}.{path}: {type(e).__name__}")
            continue
        if want is None or entries is None:
            bump(counters, "refresh_unjudged", f"{spec.name}.{path}")
            continue
        bump(counters, "refresh_checks")
        auditor.refresh_checks += 1
        wanted = _ints(want)
        if len(now) != len(wanted):  # sized for another batch (or split count) than the step's
            fname, i, built, got = f"len({path})", 0, len(wanted), len(now)
        else:
            if len(now) > len(entries):
                bump(counters, "refresh_entries_unjudged", f"{spec.name}.{path}", len(now) - len(entries))
            i = next((j for j in entries if wanted[j] != now[j]), None)
            if i is None:
                continue
            (fname, i), built, got = auditor.field_at(md, path, len(now), i), wanted[i], now[i]
        found.append(Mismatch(auditor.label_of(md), path, fname, i, built, got, STALE_REFRESH))
    if found:
        bump(counters, "refresh_stale")
    auditor.mismatches += found
    return found


# What a backend's refresh must hand the call that computes its fields, for the step its views show: the builder's
# method it calls and, per argument, the view the argument must equal and how many entries past the batch's request
# count belong to it (vLLM 0.34.0's FLASH_ATTN: _get_scheduler_metadata(seqlens=metadata.seq_lens,
# cu_query_lens=metadata.query_start_loc)). FA3's answer depends on seq_lens only through block counts, so a refresh
# computed for the previous step (the source mutant refresh-previous-step) writes what the builder gives unless a
# sequence crosses a block at that step (on the H100 the gate's shapes never did: not caught); what it passed shows it
# at every eager refresh.
INPUTS: dict[str, tuple[str, dict[str, tuple[Callable[[Any], Any], int]]]] = {
    "FLASH_ATTN": (
        "_get_scheduler_metadata",
        {"seqlens": (lambda md: md.seq_lens, 0), "cu_query_lens": (lambda md: md.query_start_loc, 1)},
    )
}


class InputWatch:
    """The calls a refresh makes to its builder's computing method (INPUTS), their keyword arguments kept (`calls`):
    the method shadowed on the builder instance for the refresh's duration, then given back. Off (no shadow, no calls)
    where `on` is false, for a backend without such a method, or where the instance already holds that name."""

    def __init__(self, builder: Any, spec: BackendFields, on: bool) -> None:
        self.builder, self.calls = builder, []
        name = INPUTS.get(spec.name, ("", {}))[0]
        orig = getattr(builder, name, None) if on and name else None
        self.name = name if callable(orig) and name not in getattr(builder, "__dict__", {name: 0}) else None
        self.orig = orig

    def __enter__(self) -> InputWatch:
        if self.name is not None:
            orig, calls = self.orig, self.calls

            def watched(*args: Any, **kwargs: Any) -> Any:
                calls.append({} if args else dict(kwargs))  # a positional call is not read by name: unjudged
                return orig(*args, **kwargs)

            setattr(self.builder, self.name, watched)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.name is not None:
            with contextlib.suppress(AttributeError):
                delattr(self.builder, self.name)


def _by_keyword(counters: dict[str, Any], spec: BackendFields, calls: list[dict]) -> Iterator[dict]:
    """The calls' keyword arguments; a call with positional arguments only (InputWatch kept {}: nothing to read by
    name) counted in refresh_unjudged instead."""
    for kwargs in calls:
        if kwargs:
            yield kwargs
        else:
            bump(counters, "refresh_unjudged", f"{spec.name}.input: a call without keyword arguments")


def judge_inputs(
    auditor: FreshnessAuditor,
    counters: dict[str, Any],
    md: Any,
    spec: BackendFields,
    calls: list[dict],
    count_stale: bool = True,
) -> list[Mismatch]:
    """What an eager refresh passed to its computing method (InputWatch) against the views of the step it refreshed,
    over the batch's own entries: another step's seq_lens or another batch's query_start_loc is a Mismatch of kind
    stale-refresh at buffer "scheduler input". The very view passed is equal without a copy (vLLM's own refresh);
    another tensor is copied to the host and compared. Counted: refresh_input_checks; an argument that could not be
    read is refresh_unjudged (never raised into vLLM's loop); refresh_stale once for the refresh (`count_stale`:
    not where judge already counted it)."""
    found: list[Mismatch] = []
    for kwargs in _by_keyword(counters, spec, calls):
        b = kwargs.get("batch_size")
        for arg, (view_of, extra) in INPUTS.get(spec.name, ("", {}))[1].items():
            passed = kwargs.get(arg)
            try:
                want = view_of(md)
                if passed is None or want is None:
                    continue
                bump(counters, "refresh_input_checks")
                if passed is want:
                    continue
                got, wanted = _ints(passed), _ints(want)
            except Exception as e:  # noqa: BLE001  counted, never raised into vLLM's draft loop
                bump(counters, "refresh_unjudged", f"{spec.name}.input {arg}: {type(e).__name__}")
                continue
            n = min(len(got), len(wanted), b + extra if isinstance(b, int) and b > 0 else len(wanted))
            i = next((j for j in range(n) if got[j] != wanted[j]), None)
            if i is not None:
                found.append(
                    Mismatch(auditor.label_of(md), "scheduler input", arg, i, wanted[i], got[i], STALE_REFRESH)
                )
    if found and count_stale:
        bump(counters, "refresh_stale")
    auditor.mismatches += found
    return found


def same_memory(passed: Any, view: Any) -> bool:
    """`passed` reads the view's own memory from its first entry on (the view itself, or a slice or view of it with
    the same start, dtype and stride): what the graph records reads what every replay's batch wrote there."""
    if passed is view:
        return True
    try:
        return (
            passed.data_ptr() == view.data_ptr()
            and passed.dtype == view.dtype
            and tuple(passed.stride()) == tuple(view.stride())
            and passed.numel() <= view.numel()
        )
    except Exception:  # noqa: BLE001  a tensor that cannot say: not the view, never raised into vLLM's capture
        return False


def judge_inputs_in_capture(counters: dict[str, Any], md: Any, spec: BackendFields, calls: list[dict]) -> None:
    """A refresh recorded inside a capture: which tensors it handed its computing method (InputWatch), never their
    contents (nothing may be copied to the host while a graph is captured, and a tensor the graph computes holds
    nothing until it replays). An argument that reads the view's own memory (same_memory) counts in
    refresh_input_checks; another tensor (one computed from the views, as the source mutant refresh-previous-step's
    seq_lens - 1, or a copy taken before the capture, which every replay would read unchanged) is counted in
    refresh_unjudged, named: what it holds at replay is not seen here (its eager twin is judged by value)."""
    for kwargs in _by_keyword(counters, spec, calls):
        for arg, (view_of, _extra) in INPUTS.get(spec.name, ("", {}))[1].items():
            passed = kwargs.get(arg)
            try:
                want = view_of(md)
            except Exception:  # noqa: BLE001  counted, never raised into vLLM's capture
                want = None
            if passed is None or want is None:
                continue
            if same_memory(passed, want):
                bump(counters, "refresh_input_checks")
            else:
                bump(counters, "refresh_unjudged", f"{spec.name}.input {arg} in a capture: not the step's view")


def not_judged(counters: dict[str, Any], spec: BackendFields, views: dict[str, Any]) -> None:
    """A refresh left unjudged because the request asked for no judging: each field it computed counted in
    refresh_unjudged (the counters' refresh_judging says why)."""
    for path in computed_fields(spec, views):
        if views.get(path) is not None:
            bump(counters, "refresh_unjudged", f"{spec.name}.{path}")


@dataclass
class StaleRefreshInjector(StaleCaptureInjector):
    """The self control's form stale-refresh (see the module): nothing taken from the target's captures, no draft
    metadata replaced; every refresh of a draft's metadata recomputed for the step FAR tokens ahead. Counted in
    inject_writes ("draft refresh"), inject_refresh_changed (eager refreshes whose fields it changed in a batch's own
    entries: one it did not change is no control of that step), inject_no_source (a refresh it could not recompute)."""

    spec: BackendFields | None = None
    refreshed: ByIdentity[None] = field(default_factory=ByIdentity)  # metadata it rewrote: reached() says so

    def target_built(self, label: str, views: dict[str, Any]) -> bool:
        return False

    def inject(self, md: Any, views: dict[str, Any], when: str) -> bool:
        return False

    def reuse(self, builder: Any, md: Any, where: Pass | None) -> Any:
        return md

    def capture_begins(self, kind: str) -> None:
        self.new_pass()

    def reached(self, views: dict[str, Any], md: Any = None) -> bool:
        return md is not None and md in self.refreshed

    def after_refresh(self, builder: Any, md: Any, spec: BackendFields, views: dict[str, Any], capturing: bool) -> bool:
        """vLLM's refresh of md returned: its computed fields written again for the step FAR tokens ahead (recorded
        into the graph when `capturing`). True when something was written."""
        wrote = False
        for path in computed_fields(spec, views):
            view, rule = views.get(path), REFRESHES.get(spec.name, {}).get(path)
            want = rule.compute(builder, md, -FAR) if rule is not None and view is not None else None
            if want is None:
                bump(self.counters, "inject_no_source", "draft refresh")
                continue
            n = min(view.numel(), want.numel())
            if not capturing and _batch_changed(view, want, rule.entries(md, view.numel())):
                bump(self.counters, "inject_refresh_changed")
            view[:n].copy_(want[:n])
            wrote = True
        if wrote:
            self.refreshed.add(md)
            self._wrote("draft refresh", views)
        return wrote


def _batch_changed(view: Any, want: Any, entries: list[int] | None) -> bool:
    """Does the injected answer differ from what the refresh wrote in an entry of the refreshed batch (every
    entry the two share where no layout is known)? Copies to the host."""
    now, wanted = _ints(view), _ints(want)
    if len(now) != len(wanted):
        return True
    return any(now[j] != wanted[j] for j in (entries if entries is not None else range(len(now))))


def make_refresh_injector(counters: dict[str, Any], announce: Callable[[dict], None]) -> StaleRefreshInjector:
    return StaleRefreshInjector(counters, announce=announce)
