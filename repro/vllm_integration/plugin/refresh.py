"""The draft-decode refresh judged, never trusted: vLLM's update_draft_decode_metadata (0.28 on) rewrites a draft's
metadata in place between draft steps, eagerly or recorded inside the fused draft graph (FLASH_ATTN recomputes FA3's
scheduler_metadata from the views' query_start_loc and seq_lens; TRITON_ATTN's and FLASHINFER's are no-ops in
0.34.0). After each eager refresh, and at the end of a capture whose metadata was refreshed inside it, every field
the refresh computes is compared with what the build's own builder gives for that draft step: the step's batch (the
request count and query_start_loc the views show) and its seq_lens (advanced by the draft loop to this step, as the
views show them when the refresh runs). A refresh that disagrees computed for another step or batch: a Mismatch of
kind stale-refresh. Only then does what the views show become the metadata's new reference (audit.refresh).

What each backend's refresh computes and how the builder gives it (REFRESHES), by field path: a field the backend's
table says its refresh rewrites (backend_fields.refreshed_in_graph, other than the draft loop's own step fields)
without a rule here, or a builder without the method the rule calls, is counted in refresh_unjudged and left out:
the gate cannot vouch for it, and says so.

The self control's form stale-refresh (StaleRefreshInjector): after every refresh of a draft's metadata, the fields
it computes are computed again by the same builder for the previous draft step (seq_lens one less, clamped at 0) and
written into the same views; inside a capture those writes are recorded into the graph, so every replay computes for
the previous step, as the source mutant `refresh-previous-step` (scripts/mutate_vllm.py) does."""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from repro.vllm_integration.plugin.audit import STALE_REFRESH, FreshnessAuditor, Mismatch, _ints
from repro.vllm_integration.plugin.backend_fields import DRAFT_STEP, BackendFields
from repro.vllm_integration.plugin.identity import ByIdentity
from repro.vllm_integration.plugin.inject import Pass, StaleCaptureInjector, bump

# a rule: (the builder, the metadata, how many draft steps back) -> what the builder gives for the field; None when
# the builder cannot say (it lacks the method vLLM's refresh calls)
Rule = Callable[[Any, Any, int], Any]


# off: on a healthy vLLM 0.34.0 (H100, results/h100-gate-default-cold) the judging found DFlash's refresh "stale"
# in a padding entry past the batch (prepare_seqlen_q[62] of t248r62), a false alarm; off until it judges only the
# batch's own entries and a GPU record shows it clean
JUDGED = False


def enabled() -> bool:
    """Is the refresh judged (JUDGED)? Otherwise an eager refresh is its metadata's new reference, as before."""
    return JUDGED


def _step_seq_lens(md: Any, back: int) -> Any:
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


REFRESHES: dict[str, dict[str, Rule]] = {"FLASH_ATTN": {"scheduler_metadata": _fa3_scheduler_metadata}}


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
    """Every field the refresh of md computed, against what `builder` gives for the step the views show now; the
    mismatches (kind stale-refresh) are kept by the auditor and returned. Counted: refresh_checks (fields compared),
    refresh_stale, refresh_unjudged (backend.field: no rule, or the builder lacks its method). Copies to the host:
    never call it while a graph is being captured."""
    found: list[Mismatch] = []
    for path in computed_fields(spec, views):
        if views.get(path) is None:
            continue  # the refresh wrote nothing there (vLLM's returns early without scheduler metadata)
        rule = REFRESHES.get(spec.name, {}).get(path)
        want = rule(builder, md, 0) if rule is not None else None
        if want is None:
            bump(counters, "refresh_unjudged", f"{spec.name}.{path}")
            continue
        bump(counters, "refresh_checks")
        auditor.refresh_checks += 1
        wanted, now = _ints(want), _ints(views[path])
        if now[: len(wanted)] == wanted and len(now) == len(wanted):
            continue
        i = next((j for j, (x, y) in enumerate(zip(wanted, now)) if x != y), min(len(wanted), len(now)))
        fname, fi = auditor.field_at(md, path, len(now), i)
        found.append(
            Mismatch(
                auditor.label_of(md),
                path,
                fname if len(now) == len(wanted) else f"len({path})",
                fi,
                wanted[i] if i < len(wanted) else len(wanted),
                now[i] if i < len(now) else len(now),
                STALE_REFRESH,
            )
        )
    if found:
        bump(counters, "refresh_stale")
    auditor.mismatches += found
    return found


@dataclass
class StaleRefreshInjector(StaleCaptureInjector):
    """The self control's form stale-refresh (see the module): nothing taken from the target's captures, no draft
    metadata replaced; every refresh of a draft's metadata recomputed for the previous step. Counted in inject_writes
    ("draft refresh"), inject_refresh_changed (eager refreshes whose fields it changed: a step whose previous step's
    answer is the same is no control of that step), inject_no_source (a refresh it could not recompute)."""

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
        """vLLM's refresh of md returned: its computed fields written again for the previous step (recorded into
        the graph when `capturing`). True when something was written."""
        wrote = False
        for path in computed_fields(spec, views):
            view, rule = views.get(path), REFRESHES.get(spec.name, {}).get(path)
            want = rule(builder, md, 1) if rule is not None and view is not None else None
            if want is None:
                bump(self.counters, "inject_no_source", "draft refresh")
                continue
            n = min(view.numel(), want.numel())
            if not capturing and not bool((view[:n] == want[:n]).all()):
                bump(self.counters, "inject_refresh_changed")
            view[:n].copy_(want[:n])
            wrote = True
        if wrote:
            self.refreshed.add(md)
            self._wrote("draft refresh", views)
        return wrote


def make_refresh_injector(counters: dict[str, Any], announce: Callable[[dict], None]) -> StaleRefreshInjector:
    return StaleRefreshInjector(counters, announce=announce)
