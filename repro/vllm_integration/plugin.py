"""The harness inside vLLM, as a general plugin (entry point group `vllm.general_plugins`). vLLM loads it in every
process it starts; each feature is off unless its environment variable turns it on:

- REPRO_AUDIT=1           freshness auditor: wraps FlashAttentionMetadataBuilder.build (record what each build's views
                          show) and FlashAttentionImpl.forward (before every eager forward, check they still show it).
                          Findings go to stderr as `REPRO_AUDIT <json>` lines and, at exit, to REPRO_AUDIT_FILE.
- REPRO_SM_MARGIN=N       FA3 plans and launches for N fewer SMs: sm_margin passed to vLLM's get_scheduler_metadata
                          and to every torch.ops._vllm_fa3_C.fwd call (vLLM itself always passes 0).
- REPRO_POISON=<fill>     the entries FA3's get_scheduler_metadata never writes are filled (repro.poison) before vLLM
                          copies them into its persistent buffer, so a stale read does not depend on leftover memory.
- REPRO_WEIGHTS=margin    dummy weights with margins: after vLLM's DummyModelLoader, every parameter is redrawn from a
                          per-name seed (norms 1, embeddings N(0,1), linear layers N(0, 1/fan_in)). vLLM's own dummy
                          weights (uniform +-1e-3, one seed per size) give near-tied logits and tokens that flip with
                          the SM count.

Each installed feature is announced as a `REPRO_PLUGIN <json>` line, so a run can prove the entry point loaded it.
Written against the names in vllm/v1/attention/backends/flash_attn.py; anything not found is reported, never guessed."""

from __future__ import annotations

import atexit
import functools
import json
import os
import sys
import zlib
from typing import Any

from repro.vllm_integration.audit import FreshnessAuditor

ENV, FILE_ENV = "REPRO_AUDIT", "REPRO_AUDIT_FILE"
SM_MARGIN_ENV, POISON_ENV, WEIGHTS_ENV = "REPRO_SM_MARGIN", "REPRO_POISON", "REPRO_WEIGHTS"
PLUGIN_TAG, AUDIT_TAG = "REPRO_PLUGIN", "REPRO_AUDIT"
AUDITOR = FreshnessAuditor()
_installed: set[str] = set()


def _views(md: Any) -> dict[str, Any]:
    return {name: getattr(md, name, None) for name in ("query_start_loc", "seq_lens", "scheduler_metadata")}


def _shape(md: Any) -> dict[str, Any]:
    qsl = getattr(md, "query_start_loc", None)
    return {
        "num_reqs": (qsl.shape[0] - 1) if qsl is not None else None,
        "max_query_len": getattr(md, "max_query_len", 1),
        "max_seq_len": getattr(md, "max_seq_len", 1 << 30),
        "causal": getattr(md, "causal", True),
    }


def _label(md: Any) -> str:
    s = _shape(md)
    return f"t{getattr(md, 'num_actual_tokens', '?')}r{s['num_reqs']}"


def _emit(obj: dict, tag: str = AUDIT_TAG) -> None:
    sys.stderr.write(f"{tag} {json.dumps(obj)}\n")
    sys.stderr.flush()


def install(module: Any) -> None:
    """Install the freshness auditor on a flash_attn backend module (passed in so tests can hand it a stand-in)."""
    builder_cls = getattr(module, "FlashAttentionMetadataBuilder", None)
    impl_cls = getattr(module, "FlashAttentionImpl", None)
    if builder_cls is None or impl_cls is None:
        _emit({"error": f"{module.__name__}: FlashAttentionMetadataBuilder/FlashAttentionImpl not found"})
        return
    orig_build, orig_forward = builder_cls.build, impl_cls.forward

    def build(self, *args: Any, **kwargs: Any):
        md = orig_build(self, *args, **kwargs)
        shape = _shape(md)
        shape["head_dim"] = getattr(self, "headdim", 128)
        AUDITOR.record_build(id(md), _label(md), _views(md), shape)
        return md

    def forward(
        self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any, *a: Any, **k: Any
    ):
        if attn_metadata is not None and not _capturing():
            for m in AUDITOR.check(id(attn_metadata), _views(attn_metadata)):
                _emit({"stale": m.to_dict(), "message": str(m)})
        return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **k)

    builder_cls.build, impl_cls.forward = build, forward
    _installed.add("audit")


def install_fa3_hooks(module: Any, ops: Any, sm_margin: int = 0, poison: Any = None) -> list[str]:
    """sm_margin and/or poison in vLLM's FA3 calls. `module` is the backend module holding the name
    get_scheduler_metadata (vLLM imports it into flash_attn.py); `ops` is torch.ops._vllm_fa3_C. Returns what it did."""
    done = []
    orig_sched = getattr(module, "get_scheduler_metadata", None)
    if orig_sched is None:
        _emit({"error": f"{module.__name__}: get_scheduler_metadata not found"}, PLUGIN_TAG)
        return done

    @functools.wraps(orig_sched)
    def get_scheduler_metadata(*args: Any, **kwargs: Any):
        if sm_margin:
            kwargs["sm_margin"] = sm_margin
        md = orig_sched(*args, **kwargs)
        if poison is not None and md is not None:
            _poison_padding(md, poison, kwargs)
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
            _emit({"error": "torch.ops._vllm_fa3_C.fwd has no sm_margin argument"}, PLUGIN_TAG)
            return done
        idx = names.index("sm_margin")

        def fwd_with_margin(*args: Any, **kwargs: Any):
            if len(args) > idx:
                args = (*args[:idx], sm_margin, *args[idx + 1 :])
            else:
                kwargs["sm_margin"] = sm_margin
            return fwd(*args, **kwargs)

        ops.fwd = fwd_with_margin
        done.append(f"_vllm_fa3_C.fwd sm_margin={sm_margin} (argument {idx})")
    return done


def _poison_padding(md: Any, poison: Any, kwargs: dict) -> None:
    from repro.layout import VLLM, effective_causal, layout_from_size

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
        _emit({"error": f"poison: {e}"}, PLUGIN_TAG)
        return
    poison.apply(md, lay)


def margin_weights(model: Any, seed: int = 0) -> int:
    """Redraw every floating parameter from a seed of its own name; returns how many were drawn."""
    import torch

    n = 0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not torch.is_floating_point(p):
                continue
            if p.dim() < 2:
                p.fill_(1.0)  # RMSNorm weights (the Llama family has no biases)
            else:
                g = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
                std = 1.0 if "embed_tokens" in name else p.shape[1] ** -0.5
                p.copy_(torch.randn(tuple(p.shape), generator=g) * std)
            n += 1
    return n


def install_margin_weights(loader_cls: Any) -> None:
    orig = loader_cls.load_weights

    def load_weights(self, model: Any, model_config: Any) -> None:
        orig(self, model, model_config)
        _emit({"weights": "margin", "parameters": margin_weights(model)}, PLUGIN_TAG)

    loader_cls.load_weights = load_weights
    _installed.add("weights")


def _capturing() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    except Exception:
        return False


def _write_report() -> None:
    path = os.environ.get(FILE_ENV)
    _emit({"summary": AUDITOR.report(), "checks": AUDITOR.checks, "stale": len(AUDITOR.mismatches)})
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "checks": AUDITOR.checks,
                    "mismatches": [m.to_dict() for m in AUDITOR.mismatches],
                    "summary": AUDITOR.report(),
                },
                f,
                indent=1,
            )


def requested(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The features the environment asks for, validated (bad values raise ValueError naming the variable)."""
    from repro.poison import parse_poison

    env = os.environ if environ is None else environ
    out: dict[str, Any] = {"audit": env.get(ENV) == "1"}
    margin = env.get(SM_MARGIN_ENV, "0") or "0"
    try:
        out["sm_margin"] = int(margin)
    except ValueError:
        raise ValueError(f"{SM_MARGIN_ENV}={margin!r}: expected a whole number of SMs") from None
    if out["sm_margin"] < 0:
        raise ValueError(f"{SM_MARGIN_ENV}={margin!r}: must not be negative")
    out["poison"] = parse_poison(env.get(POISON_ENV))
    weights = env.get(WEIGHTS_ENV, "")
    if weights not in ("", "dummy", "margin"):
        raise ValueError(f"{WEIGHTS_ENV}={weights!r}: expected margin or dummy")
    out["weights"] = weights == "margin"
    return out


def register() -> None:
    """vLLM calls this in every process it starts (general plugins)."""
    try:
        want = requested()
    except Exception as e:  # a bad variable must be visible, not silently ignored
        _emit({"error": str(e)}, PLUGIN_TAG)
        return
    if not (want["audit"] or want["sm_margin"] or want["poison"] or want["weights"]):
        return
    try:
        from vllm.v1.attention.backends import flash_attn
    except ImportError as e:
        _emit({"error": f"cannot import vLLM's FlashAttention backend: {e}"}, PLUGIN_TAG)
        return
    if want["audit"] and "audit" not in _installed:
        install(flash_attn)
        atexit.register(_write_report)
        _emit({"installed": "audit"}, PLUGIN_TAG)
    if (want["sm_margin"] or want["poison"]) and "fa3" not in _installed:
        import torch

        try:
            import vllm.vllm_flash_attn._vllm_fa3_C  # noqa: F401  registers torch.ops._vllm_fa3_C
        except ImportError as e:
            _emit({"error": f"vLLM's FA3 library does not import: {e}"}, PLUGIN_TAG)
            return
        done = install_fa3_hooks(flash_attn, torch.ops._vllm_fa3_C, want["sm_margin"], want["poison"])
        _installed.add("fa3")
        _emit({"installed": "fa3", "hooks": done}, PLUGIN_TAG)
    if want["weights"] and "weights" not in _installed:
        from vllm.model_executor.model_loader import dummy_loader

        install_margin_weights(dummy_loader.DummyModelLoader)
        _emit({"installed": "weights"}, PLUGIN_TAG)
