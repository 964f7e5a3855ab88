"""An object allocated where a dead one lived: what a record keyed by id() would hand the dead one's record to."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def reborn(make_dead: Callable[[], Any], make: Callable[[], Any], tries: int = 10_000) -> Any:
    """A new object from make() at the address of the object make_dead() returned, once that one is dead (CPython
    hands a freed block to the next object of its size). The misses are kept alive meanwhile, so each try takes
    another block; nothing is allocated between the death and the first try."""
    misses: list[Any] = []
    misses.append(None)  # the list's own storage, allocated before the death
    obj = make_dead()
    address = id(obj)
    del obj
    for _ in range(tries):
        new = make()
        if id(new) == address:
            return new
        misses.append(new)
    pytest.fail(f"none of {tries} new objects took the dead one's address: the id-reuse tests cannot run here")
