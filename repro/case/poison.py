"""Adversarial fills for the scheduler-metadata entries FA3 never writes ([b, round_up(b, 4)) of every vector).

Left alone those entries hold whatever the allocation held, so stale outcomes change from run to run. A fixed
fill makes them repeatable; which fill exposes a fault is an empirical question (INT_MAX did on the H200)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from repro.backends.layout import MetadataLayout
from repro.errors import ConfigError

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)
NAMED = {"zero": 0, "minus-one": -1, "int-max": INT32_MAX, "int-min": INT32_MIN, "splits-33": 33}
DEFAULT_POISON = "int-max"  # the matrix's and `run`'s fill: the one that made stale faults repeatable on the H200


@dataclass(frozen=True)
class Poison:
    name: str
    value: int

    def apply(self, md: Any, layout: MetadataLayout) -> int:
        """Fill the never-written entries of a freshly returned metadata tensor in place; returns how many."""
        idx = layout.padding_indices()
        if idx:
            md.view(-1)[idx] = self.value
        return len(idx)


def parse_poison(spec: str | None) -> Poison | None:
    """`none`, a name from NAMED, or an int32 literal (decimal or 0x hex)."""
    if spec is None or spec in ("", "none"):
        return None
    if spec in NAMED:
        return Poison(spec, NAMED[spec])
    try:
        value = int(spec, 0)
    except ValueError:
        raise ConfigError(f"bad poison {spec!r}: use none, {', '.join(NAMED)} or an int32") from None
    if not INT32_MIN <= value <= INT32_MAX:
        raise ConfigError(f"poison {value} does not fit in int32")
    return Poison(str(value), value)
