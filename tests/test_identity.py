"""ByIdentity (repro.vllm_integration.plugin.identity): a record per object, by identity, that never outlives it."""

from __future__ import annotations

from dataclasses import dataclass

from repro.vllm_integration.plugin.identity import ByIdentity
from tests.reused_address import reborn


@dataclass
class _Md:  # as vLLM's metadata: a dataclass, equal by fields, not hashable
    n: int


def test_an_object_born_at_a_dead_ones_address_inherits_none_of_its_record():
    records: ByIdentity[str] = ByIdentity()

    def recorded():
        md = _Md(1)
        records[md] = "its build"
        return md

    newcomer = reborn(recorded, lambda: _Md(1))
    assert len(records) == 0  # gone with its object
    assert newcomer not in records and records.get(newcomer) is None


def test_records_go_by_identity_never_by_equality():
    a, b = _Md(1), _Md(1)  # equal, distinct
    records: ByIdentity[str] = ByIdentity()
    assert records.setdefault(a, "a") == "a" and records.setdefault(a, "again") == "a"
    assert b not in records
    records[b] = "b"
    assert (records.get(a), records.get(b), len(records)) == ("a", "b", 2)


def test_an_object_without_weak_references_is_held_while_recorded():
    records: ByIdentity[None] = ByIdentity()
    records.add(md := {"built_for": 8})  # a dict takes no weak reference
    address = id(md)
    del md
    held = next(iter(records._records.values()))[0]()
    assert id(held) == address and held in records  # still alive: its address cannot be another's
    records.clear()
    assert not records
