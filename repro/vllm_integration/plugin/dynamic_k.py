"""Dynamic speculative decoding inside vLLM (0.34.0: `num_speculative_tokens_per_batch_size`): the autoregressive
speculator's draft decode manager captures one FULL graph per (batch descriptor, K), its descriptor a
SpeculatorBatchDescriptor with `num_speculative_tokens` (SpeculatorCudaGraphManager.capture with
specialize_spec_tokens), and dispatches each batch to the graph of the K its schedule gives that batch size. Each
such graph runs its own K - 1 draft steps and must be captured on metadata built for its own pass.

The descriptor check keyed by K: every metadata build inside a FULL capture pass whose descriptor names a K records
that K (build_k, in the build's shape as `num_speculative_tokens`); the descriptor check of a FULL pass whose
descriptor names a K compares it (audit.descriptor_mismatches: stale-descriptor, field `num_speculative_tokens`) and
is counted per K (descriptor_checks_by_k). No metadata field holds K: what the build was made for is read from the
capture loop on its call stack, as the descriptor is.

The self control's form stale-k (StaleKInjector, the gate runs it for its dynamic-K methods): inside a draft FULL
capture, a pass of descriptor (T tokens, R requests, K) gets the metadata the same builder built first for the same
graph manager, T, R and pass under another K: the same batch shape, another K's build. Only the K-keyed check sees
it (counted in inject_other_k)."""

from __future__ import annotations

from typing import Any

from repro.vllm_integration.plugin.identity import ByIdentity
from repro.vllm_integration.plugin.inject import PASS_NAMES, STALE_K, Pass, StaleCaptureInjector

__all__ = ["STALE_K", "StaleKInjector", "build_k", "capture_k"]
K_FIELD = "num_speculative_tokens"  # the name the build's shape and the descriptor check give K


def capture_k(frame: Any, depth: int = 60) -> tuple[Any, int] | None:
    """(the capture loop's descriptor, its K) of the nearest `capture` frame of a *CudaGraphManager* holding a FULL
    `desc` with an int num_speculative_tokens; None elsewhere. Reads a frame's locals only where its function is
    named capture (cheap at every eager build)."""
    f = frame
    for _ in range(depth):
        if f is None:
            return None
        if f.f_code.co_name == "capture":
            loc = f.f_locals
            desc = loc.get("desc")
            if "CudaGraphManager" in type(loc.get("self")).__name__ and hasattr(desc, "cg_mode"):
                mode = getattr(desc.cg_mode, "name", desc.cg_mode)
                k = getattr(desc, K_FIELD, None)
                return (desc, k) if str(mode) == "FULL" and isinstance(k, int) else None
        f = f.f_back
    return None


def build_k(frame: Any) -> dict[str, int]:
    """What a build's shape records of its K: {num_speculative_tokens: K} inside a K-specialized FULL pass, else {}."""
    found = capture_k(frame)
    return {K_FIELD: found[1]} if found is not None else {}


class StaleKInjector(StaleCaptureInjector):
    """The form stale-k (see the module): nothing taken from the target's captures, nothing written into buffers;
    a K-specialized draft FULL pass handed another K's metadata of the same batch shape."""

    def __init__(self, counters: dict[str, Any], announce: Any = lambda record: None) -> None:
        super().__init__(counters, announce=announce)
        # builder -> manager -> (T, R, warmup) -> (its K, the metadata built first for it)
        self.by_shape: ByIdentity[ByIdentity[dict[tuple, tuple[int, Any]]]] = ByIdentity()

    def target_built(self, label: str, views: dict[str, Any]) -> bool:
        return False

    def inject(self, md: Any, views: dict[str, Any], when: str) -> bool:
        return False

    def capture_begins(self, kind: str) -> None:
        self.new_pass()

    def other_k(self, builder: Any, md: Any, where: Pass | None, frame: Any) -> Any:
        """A draft capture's build returned md: in a FULL pass of a K-specialized descriptor, the metadata built
        first for the same builder, manager, batch shape and pass under another K instead; md as built otherwise
        (the first K of each shape is kept)."""
        found = capture_k(frame)
        if found is None or not self.replaces(md, where):
            return md
        desc, k = found
        shapes = self.by_shape.setdefault(builder, ByIdentity()).setdefault(where[0], {})
        key = (getattr(desc, "num_tokens", None), getattr(desc, "num_reqs", None), where[2])
        first_k, first = shapes.setdefault(key, (k, md))
        if first_k == k:
            return md
        self.reused.add(first)
        self._bump("inject_other_k", PASS_NAMES[where[2]])
        if sum(self.counters["inject_other_k"].values()) == 1:
            self.announce({"injection_wrote": "draft metadata of another K", "source": f"k{first_k} for k{k}"})
        return first
