"""Stale-view diff: which fields a metadata view shows differ from a fresh build of the batch being launched."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from repro.builder import AttnMetadata


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
        return f"{self.buffer}.{self.field}[{self.index}]: {self.seen} (fresh {self.fresh})"


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
    counts: dict[str, int] = {}
    for d in diffs:
        key = f"{d.buffer}.{d.field}" if d.buffer == "scheduler_metadata" else d.buffer
        counts[key] = counts.get(key, 0) + 1
    return counts
