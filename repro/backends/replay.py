"""A backend that answers get_scheduler_metadata from buffers recorded on a GPU (repro.fa3_model.record).

It lets the CPU tier run the builder, layouts, poison and stale diffs on what FA3 really returned, padding
entries included. It has no forward: cases that launch kernels need a real backend."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

from repro.backends.base import BackendIdentity
from repro.backends.scheduler_inputs import SchedulerInputs
from repro.errors import BackendUnavailable


def load_records(path: str | Path) -> tuple[dict, list[dict]]:
    with gzip.open(path, "rt") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or not lines[0].get("header"):
        raise ValueError(f"{path}: not a repro.fa3_model.record file")
    return lines[0], lines[1:]


class ReplayBackend:
    def __init__(self, path: str | Path) -> None:
        self.header, self.records = load_records(path)
        ident = self.header["backend"]
        self.flavor = ident["name"]
        self.name = f"replay-{self.flavor}"
        self._identity = BackendIdentity(
            self.name, ident["package"], ident["version"], ident["library"], ident["sha256"]
        )
        self._table = {SchedulerInputs.from_record(self.header, r): r for r in self.records}

    @property
    def sms(self) -> int:
        return int(self.header["sms"])

    def identity(self) -> BackendIdentity:
        return self._identity

    def scheduler_metadata(self, **call: Any) -> Any:
        import torch  # torch only when tensors are made: the module loads without it

        rec = self._table.get(SchedulerInputs.from_call(self.flavor, self.sms, **call))
        if rec is None:
            raise KeyError(
                f"no recorded metadata for b={call['batch_size']} splits={call['num_splits']} margin={call['sm_margin']}"
            )
        return torch.tensor(rec["metadata"], dtype=torch.int32, device=call["cache_seqlens"].device)

    def forward(self, *a: Any, **k: Any) -> Any:
        raise BackendUnavailable("the replay backend has no kernels")
