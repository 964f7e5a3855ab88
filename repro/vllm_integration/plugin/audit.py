"""Freshness auditor core: remembers what every metadata build wrote, and at each eager forward checks that the
persistent buffers the metadata's views point at still hold it.

A view whose buffer was overwritten by a later build is stale: exactly the defect of vLLM PR #48261, and it is
detected on any GPU at any SM count, without waiting for an out-of-bounds read. Which views a backend's metadata
has is repro.vllm_integration.plugin.backend_fields' business; this core compares whatever views it is handed, by name
(FA3's scheduler_metadata decoded into its vectors, any other view by flat index). A refresh (vLLM's in-place
draft-decode update, run eagerly), once repro.vllm_integration.plugin.refresh judged what it computed against the
builder, makes what the views show now the new reference."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from repro.attention.staleness import stale_entry
from repro.backends.layout import VLLM, effective_causal, layout_from_size
from repro.vllm_integration.plugin.identity import ByIdentity

FIELDS = ("query_start_loc", "seq_lens", "scheduler_metadata")  # FA3's views: what the auditor checked first
Number = int | float  # bool tensors read as ints; floating tensors (none checked in vLLM's tables today) as floats
# the kinds of evidence a Mismatch is: a view whose buffer no longer holds what its build wrote, metadata (object and
# buffers, consistent with each other) built for another batch descriptor than the one being captured, or a field a
# draft-decode refresh computed that is not what the builder gives for the draft step the views show (refresh.judge)
STALE_CONTENTS, STALE_DESCRIPTOR, STALE_REFRESH = "stale-contents", "stale-descriptor", "stale-refresh"
# ... or, at a sampled replay of a FULL draft graph, a buffer it reads no longer holds what the runtime's latest build
# wrote for the batch being replayed (plugin.replay)
STALE_REPLAY = "stale-replay"
SCALARS = ("num_actual_tokens", "num_reqs", "max_query_len")  # the object fields the descriptor check compares


@dataclass(frozen=True)
class Mismatch:
    descriptor: str  # t<tokens>r<reqs> of the metadata being used
    buffer: str
    field: str  # decoded field for scheduler_metadata
    index: int  # first differing index within the field (flat index for a view of more than one dimension)
    built: Number  # what the build wrote (stale-descriptor: what the builder gives for the captured descriptor)
    now: Number
    kind: str = STALE_CONTENTS  # STALE_CONTENTS, _DESCRIPTOR or _REFRESH (records without it: contents mismatches)

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        if self.kind == STALE_REPLAY:
            return (
                f"stale at replay of {self.descriptor}: {self.field}[{self.index}] is {self.now}, the runtime's "
                f"latest build for the batch being replayed wrote {self.built}"
            )
        if self.kind == STALE_REFRESH:
            return (
                f"draft-decode refresh of {self.descriptor} computed for another step or batch: {self.field}"
                f"[{self.index}] is {self.now}, the builder gives {self.built} for the step its views show"
            )
        if self.kind == STALE_DESCRIPTOR:
            where = self.field if self.field != self.buffer else f"{self.field}[{self.index}]"
            return (
                f"attention metadata built for another descriptor while capturing {self.descriptor}: "
                f"{where} is {self.now}, the builder gives {self.built} for this descriptor"
            )
        return "stale attention metadata for " + stale_entry(
            self.descriptor, self.buffer, self.field, self.index, self.now, self.built
        )


def in_words(record: dict) -> str:
    """A Mismatch's record (to_dict, as an AUDIT line or the audit file holds it) in words: a contents mismatch as
    staleness.stale_entry names it (as recorded before the descriptor check), a stale-descriptor or stale-refresh one
    as str()."""
    if record.get("kind") in (STALE_DESCRIPTOR, STALE_REFRESH, STALE_REPLAY):
        return str(Mismatch(**{k: v for k, v in record.items() if k in Mismatch.__dataclass_fields__}))
    r = record
    return stale_entry(r["descriptor"], r["buffer"], r["field"], r["index"], r["now"], r["built"])


@dataclass
class _Build:
    descriptor: str
    values: dict[str, list[Number]]
    shape: dict[str, Any]


@dataclass
class FreshnessAuditor:
    flavor: str = VLLM
    # metadata object -> what its build wrote; by identity, never by id(): metadata built later at a dead object's
    # address inherits nothing
    builds: ByIdentity[_Build] = field(default_factory=ByIdentity)
    mismatches: list[Mismatch] = field(default_factory=list)
    checks: int = 0
    views: int = 0  # views compared over all checks (each view of a metadata object counts one per check)
    refreshes: int = 0  # eager draft-decode refreshes that became their metadata's new reference (once judged)
    refresh_checks: int = 0  # fields a draft-decode refresh computed, compared with the builder's (refresh.judge)
    loop_advances: int = (
        0  # seq_lens views the draft loop had advanced in place (uniformly, by at most `advance`): not stale
    )
    descriptor_checks: int = 0  # metadata compared with the descriptor of the FULL capture pass using it

    def record_build(
        self, key: Any, descriptor: str, views: dict[str, Any], shape: dict[str, Any] | None = None
    ) -> None:
        """Right after a build of the metadata object `key`: copy what its views show (they point into persistent
        buffers). Copies to the host: never call it while a CUDA graph is being captured."""
        self.builds[key] = _Build(descriptor, {k: _ints(v) for k, v in views.items() if v is not None}, shape or {})

    def refresh(self, key: Any, views: dict[str, Any]) -> bool:
        """After an eager in-place refresh of a recorded build's metadata (vLLM's update_draft_decode_metadata and
        the draft step around it), once refresh.judge compared what it computed with the builder's answer: what the
        views show now is what the next forward must see. False when the build is not known. Copies to the host,
        like record_build."""
        b = self.builds.get(key)
        if b is None:
            return False
        b.values = {k: _ints(v) for k, v in views.items() if v is not None}
        self.refreshes += 1
        return True

    def knows(self, key: Any) -> bool:
        return key in self.builds

    def label_of(self, key: Any) -> str:
        """The descriptor label its build recorded ('?' for a build not recorded)."""
        b = self.builds.get(key)
        return b.descriptor if b is not None else "?"

    def field_at(self, key: Any, name: str, size: int, index: int) -> tuple[str, int]:
        """(field, index) of a view's flat index, FA3's scheduler_metadata decoded by its recorded build's shape."""
        b = self.builds.get(key)
        return (name, index) if b is None else self._field(name, b, size, index)

    def check(
        self, key: Any, views: dict[str, Any], skip: frozenset[str] | set[str] = frozenset(), advance: int = 0
    ) -> list[Mismatch]:
        """Before a forward: do the views still show what their build wrote? Returns (and keeps) the mismatches.
        `skip`: views not to compare (rewritten by an in-graph refresh, their contents the graph's to compute).
        `advance` (a draft decode capture): the draft loop's own update of the same batch is not staleness: a
        seq_lens view whose every entry is its build's plus one d with 1 <= d <= advance was advanced in place
        between draft steps (vLLM's eagle layout, 0.20-0.22, runs update_draft_inputs inside the graph without
        refreshing the metadata); so is a slot_mapping view of the same check whose entries moved by that d
        (`_slots_advanced`: the loop recomputes the KV-cache slots from the advanced positions); both counted in
        loop_advances. Another descriptor's contents differ otherwise."""
        b = self.builds.get(key)
        if b is None:
            return []
        self.checks += 1
        compared = {k: v for k, v in b.values.items() if k not in skip}
        self.views += len(compared)
        found = []
        nows = {name: _ints(views.get(name)) for name in compared}
        # seq_lens views the draft loop advanced in place, and its step in this check (the d of the first; None: none)
        advanced = [
            n
            for n in compared
            if advance and n.rsplit(".", 1)[-1] == "seq_lens" and _advanced(b.values[n], nows[n], advance)
        ]
        step = nows[advanced[0]][0] - b.values[advanced[0]][0] if advanced else None
        for name, built in compared.items():
            now = nows[name]
            if now == built:
                continue
            if name in advanced:
                self.loop_advances += 1
                continue
            if step is not None and name.rsplit(".", 1)[-1] == "slot_mapping" and _slots_advanced(built, now, step):
                self.loop_advances += 1
                continue
            i = next((j for j, (x, y) in enumerate(zip(built, now)) if x != y), min(len(built), len(now)))
            fname, fi = self._field(name, b, len(built), i)
            found.append(
                Mismatch(
                    b.descriptor, name, fname, fi, built[i] if i < len(built) else -1, now[i] if i < len(now) else -1
                )
            )
        self.mismatches += found
        return found

    def check_descriptor(
        self,
        key: Any,
        desc: CaptureDescriptor,
        fields: dict[str, Any],
        views: dict[str, Any],
        skip: frozenset[str] | set[str] = frozenset(),
    ) -> tuple[list[Mismatch], str | None]:
        """At a FULL capture pass: was the metadata in use (its object's `fields` now, metadata_views.build_shape; its
        views' contents now) built for the descriptor being captured (descriptor_mismatches)? Returns (the
        mismatches, kept; None) when the check ran, ([], why) when it could not: no build of this metadata recorded
        (its builder was not hooked), or nothing of it comparable (a metadata shape it does not know)."""
        b = self.builds.get(key)
        if b is None:
            return [], "no build of the metadata in use was recorded (its builder not hooked)"
        nows = {name: _ints(v) for name, v in views.items() if v is not None and name not in skip}
        layout = {k: v for k, v in b.shape.items() if k not in SCALARS}  # what decodes FA3's layout, with `fields`
        found, compared = descriptor_mismatches(desc, {**layout, **fields}, nows)
        if not compared:
            return [], "the metadata shows none of num_actual_tokens, query_start_loc, seq_lens, slot_mapping"
        self.descriptor_checks += 1
        self.mismatches += found
        return found, None

    def _field(self, name: str, b: _Build, size: int, index: int) -> tuple[str, int]:
        if name != "scheduler_metadata":
            return name, index
        lay = layout_of(b.shape, size, self.flavor)
        if lay is None:
            return name, index
        if index >= lay.semaphore_offset:
            return "semaphore", 0
        vec, i = divmod(index, lay.batch_rounded)
        return lay.vectors[vec], i

    def report(self) -> str:
        if not self.mismatches:
            return f"freshness audit: {self.checks} checks, every view held its own build"
        first = self.mismatches[0]
        descs = sorted({m.descriptor for m in self.mismatches})
        return (
            f"freshness audit: {len(self.mismatches)} stale fields in {self.checks} checks "
            f"(descriptors {', '.join(descs)}); first: {first}"
        )


@dataclass(frozen=True)
class CaptureDescriptor:
    """The batch descriptor a FULL capture pass captures, as the capture manager on the call stack holds it (vLLM's
    BatchExecutionDescriptor: num_tokens, num_reqs, uniform_token_count / max_query_len; a speculator's
    num_speculative_tokens)."""

    mode: str
    num_tokens: int
    num_reqs: int | None  # None: the manager's rule could not be read (the request checks are left out)
    query_len: int | None  # uniform_token_count, else max_query_len; None: the descriptor does not fix it
    uniform: bool = False  # every request has query_len tokens (uniform decode)
    spec_tokens: int | None = None  # recorded in the label; no metadata field holds it

    @property
    def label(self) -> str:
        q = f" q{self.query_len}" if self.query_len else ""
        k = f" k{self.spec_tokens}" if self.spec_tokens is not None else ""
        return f"{self.mode} t{self.num_tokens}r{self.num_reqs if self.num_reqs is not None else '?'}{q}{k}"


def descriptor_mismatches(
    desc: CaptureDescriptor, built: dict[str, Any], nows: dict[str, list[Number]]
) -> tuple[list[Mismatch], list[str]]:
    """What vLLM's metadata builder gives for a descriptor of R requests, T tokens and query length q (build:
    num_actual_tokens = T, max_query_len = q; query_start_loc has R + 1 entries from 0 to T, each request q tokens
    in a uniform decode and at most q otherwise; seq_lens R entries, slot_mapping T; FA3's scheduler_metadata sized
    for R requests) against the metadata in use: `built` its build's object fields (the plugin's build shape), `nows`
    its views' contents now, by field path (top-level fields only: FlashInfer's nested wrappers are not read here).
    Returns (the mismatches, kind STALE_DESCRIPTOR; the names compared)."""
    out: list[Mismatch] = []
    compared: list[str] = []
    R, T, q = desc.num_reqs, desc.num_tokens, desc.query_len

    def differs(name: str, index: int, want: Number, now: Number, what: str | None = None) -> None:
        """`what`: a property of the view (its length, its plan's batch size) rather than an entry of it."""
        out.append(Mismatch(desc.label, name, what or name, index, want, now, STALE_DESCRIPTOR))

    def scalar(name: str, want: Number | None) -> None:
        now = built.get(name)
        if want is None or not isinstance(now, int):
            return
        compared.append(name)
        if now != want:
            differs(name, 0, want, now, f"{name} (object field)")

    scalar("num_actual_tokens", T)
    scalar("num_reqs", R)
    scalar("max_query_len", q)
    k = built.get("num_speculative_tokens")  # the K of the pass the metadata was built in (plugin.dynamic_k)
    if desc.spec_tokens is not None and isinstance(k, int):
        compared.append("num_speculative_tokens")
        if k != desc.spec_tokens:
            differs("num_speculative_tokens", 0, desc.spec_tokens, k, "num_speculative_tokens (built for)")
    qsl = nows.get("query_start_loc")
    if qsl:
        compared.append("query_start_loc")
        lens = [b - a for a, b in zip(qsl, qsl[1:])]
        if R is not None and len(qsl) != R + 1:
            differs("query_start_loc", 0, R + 1, len(qsl), "len(query_start_loc)")  # one per request, plus one
        elif qsl[0] != 0:
            differs("query_start_loc", 0, 0, qsl[0])
        elif qsl[-1] != T:
            differs("query_start_loc", len(qsl) - 1, T, qsl[-1])
        elif q and (bad := next((i for i, n in enumerate(lens) if n > q or desc.uniform and n != q), None)) is not None:
            differs("query_start_loc", bad + 1, qsl[bad] + q, qsl[bad + 1])
    for name, want in (("seq_lens", R), ("slot_mapping", T)):
        now = nows.get(name)
        if now is not None and want is not None:
            compared.append(name)
            if len(now) != want:
                differs(name, 0, want, len(now), f"len({name})")  # one entry per request (seq_lens), token (slots)
    sched = nows.get("scheduler_metadata")
    if sched and R is not None and layout_of(built, len(sched)) is not None:
        compared.append("scheduler_metadata")
        if layout_of({**built, "num_reqs": R}, len(sched)) is None:
            differs("scheduler_metadata", 0, R, built.get("num_reqs"), "scheduler_metadata batch size")
    return out, compared


def layout_of(shape: dict[str, Any], size: int, flavor: str = VLLM) -> Any:
    """The FA3 scheduler-metadata layout of a build whose metadata has this shape (num_reqs, causal, window,
    query/sequence lengths, head dim: the plugin's record of the build) and a buffer of `size` ints; None when the
    shape lacks the batch size or the size is no layout repro.backends.layout knows."""
    if shape.get("num_reqs") is None:
        return None
    try:
        is_causal, is_local = effective_causal(
            shape.get("causal", True),
            shape.get("window_left", -1),
            shape.get("max_query_len", 1),
            shape.get("max_seq_len", 1 << 30),
            shape.get("head_dim", 128),
            True,
        )
        return layout_from_size(flavor, shape["num_reqs"], size, is_causal, is_local)
    except ValueError:
        return None


def _advanced(built: list[Number], now: list[Number], limit: int) -> bool:
    """Is `now` the built values, every entry plus the same d, 1 <= d <= limit? (An empty view never is.)"""
    if not built or len(built) != len(now):
        return False
    d = now[0] - built[0]
    return 1 <= d <= limit and all(y - x == d for x, y in zip(built, now))


PAD_SLOT = -1  # vLLM's PADDING_SLOT_ID: a slot_mapping entry no token writes
PAGE_GRANULE = 16  # every KV page size FA3 takes is a multiple of 16 tokens


def _slots_advanced(built: list[Number], now: list[Number], d: int) -> bool:
    """Is `now` the slot mapping of the same tokens d positions on (the eagle draft loop recomputes it from the
    advanced positions and the block table between its steps, results/h200-release-table-2: 0.20.2, -1 -> 1 and
    21 -> 22)? Each entry: its page offset moved by d (slot + d, or another page at offset + d mod the page size, a
    multiple of PAGE_GRANULE), or the build wrote the pad slot (a padded row the loop gave a position), or the loop
    masked it (past the model length). Another descriptor's slots differ in count or place otherwise."""
    if not built or len(built) != len(now):
        return False
    return all(x == PAD_SLOT or y == PAD_SLOT or (y - x - d) % PAGE_GRANULE == 0 and y >= 0 for x, y in zip(built, now))


def _ints(v: Any) -> list[Number]:
    """A view's contents on the host, flat (ints, or floats for a floating tensor). Synchronises with the device."""
    if v is None:
        return []
    if hasattr(v, "detach"):
        flat = v.detach().to("cpu").reshape(-1)
        return [x if isinstance(x, float) else int(x) for x in flat.tolist()]
    return [x if isinstance(x, float) else int(x) for x in v]
