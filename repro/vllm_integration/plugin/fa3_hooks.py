"""The hooks on vLLM's FA3 calls: a request's sm_margin is passed to vLLM's get_scheduler_metadata and to every
torch.ops._vllm_fa3_C.fwd call (FA3 plans and launches for that many fewer SMs; vLLM itself always passes 0), and
its poison fills the scheduler-metadata entries FA3 never writes (repro.case.poison) before vLLM copies them into its
persistent buffer. Every call, margin and poisoned entry is counted (repro.vllm_integration.plugin.counters)."""

from __future__ import annotations

import functools
from typing import Any

from repro.backends.layout import VLLM, effective_causal, layout_from_size
from repro.contract.channel import emit
from repro.contract.tags import PLUGIN_TAG
from repro.vllm_integration.plugin import counters


def install_fa3_hooks(module: Any, ops: Any, sm_margin: int = 0, poison: Any = None) -> list[str]:
    """sm_margin and/or poison in vLLM's FA3 calls. `module` is the backend module holding the name
    get_scheduler_metadata (vLLM imports it into flash_attn.py); `ops` is torch.ops._vllm_fa3_C. Returns what it did;
    a hook it could not install is an error line (REPRO_PLUGIN)."""
    done = []
    orig_sched = getattr(module, "get_scheduler_metadata", None)
    if orig_sched is None:
        emit(PLUGIN_TAG, {"error": f"{module.__name__}: get_scheduler_metadata not found"})
        return done

    @functools.wraps(orig_sched)
    def get_scheduler_metadata(*args: Any, **kwargs: Any):
        counters.bump("sched_calls")
        if sm_margin:
            kwargs["sm_margin"] = sm_margin
            counters.bump("sched_sm_margin")
        md = orig_sched(*args, **kwargs)
        if poison is not None and md is not None:
            n = _poison_padding(md, poison, kwargs)
            if n is not None:
                counters.bump("poison_calls")
                counters.bump("entries_poisoned", n=n)
        return md

    module.get_scheduler_metadata = get_scheduler_metadata
    done.append(
        "get_scheduler_metadata"
        + (f" sm_margin={sm_margin}" if sm_margin else "")
        + (f" poison={poison.name}" if poison is not None else "")
    )
    if sm_margin:
        fwd = getattr(ops, "fwd", None)
        names = [a.name for a in fwd.default._schema.arguments] if fwd is not None else []
        if "sm_margin" not in names:
            emit(PLUGIN_TAG, {"error": "torch.ops._vllm_fa3_C.fwd has no sm_margin argument"})
            return done
        idx = names.index("sm_margin")

        def fwd_with_margin(*args: Any, **kwargs: Any):
            if len(args) > idx:
                args = (*args[:idx], sm_margin, *args[idx + 1 :])
            else:
                kwargs["sm_margin"] = sm_margin
            counters.bump("fwd_sm_margin")
            return fwd(*args, **kwargs)

        ops.fwd = fwd_with_margin
        done.append(f"_vllm_fa3_C.fwd sm_margin={sm_margin} (argument {idx})")
    return done


def _poison_padding(md: Any, poison: Any, kwargs: dict) -> int | None:
    """Fill the never-written entries; how many (None, and an error line, when the layout is not known)."""
    window = kwargs.get("window_size") or (-1, -1)
    is_causal, is_local = effective_causal(
        bool(kwargs.get("causal", False)),
        int(window[0]),
        int(kwargs["max_seqlen_q"]),
        int(kwargs["max_seqlen_k"]),
        int(kwargs["headdim"]),
        kwargs.get("page_size") is not None,
    )
    try:
        lay = layout_from_size(VLLM, int(kwargs["batch_size"]), md.numel(), is_causal, is_local)
    except ValueError as e:
        emit(PLUGIN_TAG, {"error": f"poison: {e}"})
        return None
    return poison.apply(md, lay)
