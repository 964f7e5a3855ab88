"""A gate case's request (repro.contract.request) for the CPU tests: every key given, as the gate gives them (not
collected: no test_ prefix)."""

from __future__ import annotations

from dataclasses import replace

from repro.contract.request import CaseRequest, PluginRequest

PLUGIN = PluginRequest(
    attention_backend="FLASH_ATTN",
    probe=False,
    audit=False,
    audit_file=None,
    sm_margin=0,
    poison=None,
    inject=None,
    inject_source="first",
    weights="dummy",
    judge_refresh=True,
    check_replay=True,
)


def plugin_request(**changes) -> PluginRequest:
    """The plugin's part, nothing installed but what `changes` ask for."""
    return replace(PLUGIN, **changes)


def case_request(plugin: PluginRequest = PLUGIN, **changes) -> CaseRequest:
    """A speculative EAGLE case's request, its model configs under `models`."""
    base = CaseRequest(
        models="models",
        reference=False,
        method="eagle",
        compile="inductor",
        vllm_inspects=False,
        own_alloc=None,
        own_alloc_fill=None,
        plugin=plugin,
    )
    return replace(base, **changes)
