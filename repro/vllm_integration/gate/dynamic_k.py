"""Dynamic speculative decoding as a gate dimension: for each method whose speculator is autoregressive (vLLM 0.34.0:
EAGLE, EAGLE3, MTP through TargetDependentARSpeculator, draft_model through StandaloneARSpeculator), a method of its
own, `<method>_dynamic_k` (case ids: `eagle-dynamic-k`), that runs the same pair with a K schedule per batch size
(speculative_config's num_speculative_tokens_per_batch_size, SCHEDULE). vLLM then captures the draft decode graphs
once per (batch descriptor, K) (SpeculatorCudaGraphManager.capture, specialize_spec_tokens) and dispatches each
batch to its K's graph; the plugin's descriptor check is keyed by K (repro.vllm_integration.plugin.dynamic_k), and
these methods get a self control of their own, the form stale-k (forms_for): a K-specialized capture fed another K's
metadata, caught in audit by the auditor's count.

Where the build lacks it, not applicable with the reason (not_supported, read from the build's files, never a version
list): no num_speculative_tokens_per_batch_size in its SpeculativeConfig, no specialize_spec_tokens in its
autoregressive capture manager, or the method's speculator not an AutoRegressiveSpeculator. DFlash drafts a block in
one parallel pass and has no graph per K: refused by name (NOT_HERE)."""

from __future__ import annotations

from pathlib import Path

from repro.vllm_integration.plugin.inject import STALE_K
from repro.vllm_integration.releases.builds import source_text

SUFFIX = "_dynamic_k"
# vLLM's schedule: inclusive batch-size ranges, the first from 1, each with its K (the gate's k is 3). vLLM captures
# a decode graph for every K of it but 0 and 1: here K=3 for batches of 1 or 2 requests, K=2 from 3 on.
SCHEDULE = ((1, 2, 3), (3, 1024, 2))
BASES = ("eagle", "eagle3", "draft_model", "mtp")
NOT_HERE = {
    "dflash" + SUFFIX: "DFlash drafts a block in one parallel pass: its capture (DFlashCudaGraphManager) has no graph "
    "per K (vLLM 0.34.0 specializes only the autoregressive speculators' draft decode graphs by K)"
}
AR_BASE = "AutoRegressiveSpeculator"  # spec_decode/autoregressive/speculator.py: the speculators specialize_spec_tokens serves


def name_of(base: str) -> str:
    return base + SUFFIX


def base_of(method: str) -> str | None:
    """The method a dynamic-K method runs (None: not one)."""
    return method[: -len(SUFFIX)] if method.endswith(SUFFIX) and method[: -len(SUFFIX)] in BASES else None


def forms_for(method: str) -> tuple[str, ...]:
    """The self-control forms of its own a method's cases get beside the gate's (stale-k for a dynamic-K method)."""
    return (STALE_K,) if base_of(method) else ()


def schedule() -> list[list[int]]:
    """SCHEDULE as speculative_config takes it (JSON-like lists)."""
    return [list(e) for e in SCHEDULE]


def not_supported(package_dir: Path, speculator: str | None, is_ar: bool) -> str | None:
    """Why this build cannot run its method with a K schedule (None: it can). `speculator`: the method's speculator
    class as the build resolves it (None: unknown, left to the base method's check); `is_ar`: whether it is an
    AutoRegressiveSpeculator or derives from one."""
    config = package_dir / "config" / "speculative.py"
    if "num_speculative_tokens_per_batch_size" not in source_text(config):
        return (
            "dynamic speculative decoding: this build's SpeculativeConfig has no num_speculative_tokens_per_batch_size"
        )
    manager = package_dir / "v1" / "worker" / "gpu" / "spec_decode" / "autoregressive" / "cudagraph_utils.py"
    if "specialize_spec_tokens" not in source_text(manager):
        return (
            "dynamic speculative decoding: its draft decode graphs are not specialized by K (no specialize_spec_tokens)"
        )
    if speculator and not is_ar:
        return (
            f"dynamic speculative decoding: its speculator {speculator} is not an autoregressive speculator ({AR_BASE})"
        )
    return None
