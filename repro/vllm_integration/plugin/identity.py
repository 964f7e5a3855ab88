"""Records kept per object, by the object's identity, that never outlive it.

An object's id() is its address: once the object dies, a new one can be given the same id and, in a dict keyed by
id, inherit the dead one's record (metadata built later audited against another build's contents, or taken for a
metadata object the self control already reused; a new builder handed a dead builder's first build). ByIdentity keys
by id but holds a weak reference to the object (or the object itself when it takes none: then its id cannot be
reused while the record is held) and answers only for that very object; a record goes when its object dies."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

V = TypeVar("V")


class ByIdentity(Generic[V]):
    """A map from objects (by identity, never by equality: metadata dataclasses are not hashable) to records."""

    def __init__(self) -> None:
        self._records: dict[int, tuple[Callable[[], Any], V]] = {}

    def _ref(self, obj: Any) -> Callable[[], Any]:
        key, records = id(obj), self._records  # the callback holds the dict, not the map

        def drop(ref: Any) -> None:
            entry = records.get(key)
            if entry is not None and entry[0] is ref:
                del records[key]

        try:
            return weakref.ref(obj, drop)
        except TypeError:  # no weak reference to it (a dict, an int, a class with __slots__): held instead
            return lambda: obj

    def _entry(self, obj: Any) -> tuple[Callable[[], Any], V] | None:
        entry = self._records.get(id(obj))
        return entry if entry is not None and entry[0]() is obj else None

    def get(self, obj: Any, default: V | None = None) -> V | None:
        entry = self._entry(obj)
        return default if entry is None else entry[1]

    def __contains__(self, obj: Any) -> bool:
        return self._entry(obj) is not None

    def __setitem__(self, obj: Any, value: V) -> None:
        entry = self._entry(obj)
        self._records[id(obj)] = (entry[0] if entry is not None else self._ref(obj), value)

    def setdefault(self, obj: Any, value: V) -> V:
        """The record of obj, `value` kept as its record when it has none."""
        entry = self._entry(obj)
        if entry is not None:
            return entry[1]
        self[obj] = value
        return value

    def add(self, obj: Any) -> None:
        """Used as a set of objects: obj is in it."""
        self.setdefault(obj, None)  # type: ignore[arg-type]

    def clear(self) -> None:
        self._records.clear()

    def values(self) -> Iterator[V]:
        return (v for ref, v in list(self._records.values()) if ref() is not None)

    def __len__(self) -> int:
        return sum(1 for ref, _ in list(self._records.values()) if ref() is not None)

    def __bool__(self) -> bool:
        return len(self) > 0
