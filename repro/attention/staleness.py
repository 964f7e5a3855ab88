"""Stale-view diff: which fields a metadata view shows differ from a fresh build of the batch being launched; and the
one way every stale entry is named and counted (the attention-layer cases here, the freshness auditor inside vLLM
(repro.vllm_integration.plugin.audit) and the gate's summary of it (repro.vllm_integration.gate.judge)).

Imports nothing at run time beyond the standard library: the auditor inside vLLM uses it."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a type only: keeps this module importable with nothing of repro's run-time stack
    from repro.attention.builder import AttnMetadata


def field_key(buffer: str, field: str) -> str:
    """The name stale entries are counted under: `buffer.field` for a decoded field of a buffer (the vectors of
    scheduler_metadata), the buffer's own name for a plain buffer (its field is the buffer)."""
    return buffer if field == buffer else f"{buffer}.{field}"


def count_fields(entries: Iterable[tuple[str, str]]) -> dict[str, int]:
    """Stale entries per field: (buffer, field) pairs counted under field_key, in the order first seen.

    What one entry is differs by caller, on purpose: diff_snapshots gives every differing entry (it has the fresh
    build's whole contents at the launch layout), the auditor inside vLLM one entry per stale view and check (its
    first differing index: it has only what the view's own build wrote, checked on every forward, and a layout
    inferred from the buffer's size). So a gate record counts stale views per field, an attention-layer record
    differing entries per field, under the same names."""
    counts: dict[str, int] = {}
    for buffer, field in entries:
        key = field_key(buffer, field)
        counts[key] = counts.get(key, 0) + 1
    return counts


def add_counts(total: dict[str, int], more: dict[str, int]) -> dict[str, int]:
    """Stale-entry counts of one more pass added into `total` (in place; returned for chaining)."""
    for k, v in more.items():
        total[k] = total.get(k, 0) + v
    return total


def entry_name(buffer: str, field: str, index: int) -> str:
    """One entry of a view: `buffer.field[index]`."""
    return f"{buffer}.{field}[{index}]"


def stale_entry(descriptor: str, buffer: str, field: str, index: int, now: int, built: int) -> str:
    """A stale entry the auditor found, in words: what the view shows now against what its build wrote."""
    return f"{descriptor}: {entry_name(buffer, field, index)} is {now}, the build wrote {built}"


@dataclass(frozen=True)
class FieldDiff:
    buffer: str  # query_start_loc | seq_lens | scheduler_metadata
    field: str  # decoded field name (the buffer name for plain buffers)
    index: int  # virtual batch index (or flat index)
    seen: int  # what the view holds at launch
    fresh: int  # what a fresh build for the launched descriptor holds

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        return f"{entry_name(self.buffer, self.field, self.index)}: {self.seen} (fresh {self.fresh})"


def diff_snapshots(used: AttnMetadata, seen: dict[str, list[int]], fresh: dict[str, list[int]]) -> list[FieldDiff]:
    """Compare snapshot contents. Scheduler metadata is decoded at the LAUNCH layout (the one the kernels use)."""
    out: list[FieldDiff] = []
    for name in ("query_start_loc", "seq_lens"):
        for i, (a, b) in enumerate(zip(seen[name], fresh[name])):
            if a != b:
                out.append(FieldDiff(name, name, i, a, b))
    lay = used.layout
    dec_seen, dec_fresh = lay.decode(seen["scheduler_metadata"]), lay.decode(fresh["scheduler_metadata"])
    for field, vals in dec_seen.items():
        for i, (a, b) in enumerate(zip(vals, dec_fresh[field])):
            if a != b:
                out.append(FieldDiff("scheduler_metadata", field, i, a, b))
    return out


def summarize(diffs: list[FieldDiff]) -> dict[str, int]:
    """Differing entries per field."""
    return count_fields((d.buffer, d.field) for d in diffs)
