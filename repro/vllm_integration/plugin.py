"""The harness inside vLLM, as a general plugin (entry point group `vllm.general_plugins`). vLLM loads it in every
process it starts; each feature is off unless its environment variable turns it on:

- REPRO_PROBE=1           coverage counters (every gate case but the references): FlashAttentionImpl.forward calls and
                          the FA version of the impl that made them, and every CUDA graph capture (torch.cuda.graph)
                          with its graph kind (target decode, target mixed, draft prefill, draft decode, read from the
                          vLLM objects on the capture's call stack; "unknown kind" when none says) and whether an
                          attention forward ran inside it (a FULL graph). The model runner class seen capturing.
- REPRO_AUDIT=1           freshness auditor (implies the probe): wraps FlashAttentionMetadataBuilder.build (record what
                          each build's views show) and FlashAttentionImpl.forward (before every eager forward, check
                          they still show it); at the end of every capture, the metadata its attention forwards used
                          is checked too (what the graph baked in). Findings go to stderr as `REPRO_AUDIT <json>`
                          lines and, at exit, to REPRO_AUDIT_FILE.
- REPRO_SM_MARGIN=N       FA3 plans and launches for N fewer SMs: sm_margin passed to vLLM's get_scheduler_metadata
                          and to every torch.ops._vllm_fa3_C.fwd call (vLLM itself always passes 0). Counted per call.
- REPRO_POISON=<fill>     the entries FA3's get_scheduler_metadata never writes are filled (repro.poison) before vLLM
                          copies them into its persistent buffer, so a stale read does not depend on leftover memory.
                          The entries poisoned are counted.
- REPRO_WEIGHTS=margin    dummy weights with margins: after vLLM's DummyModelLoader, every parameter is redrawn from a
                          per-name seed (norms 1, embeddings N(0,1), linear layers N(0, 1/fan_in)). vLLM's own dummy
                          weights (uniform +-1e-3, one seed per size) give near-tied logits and tokens that flip with
                          the SM count.

Each feature that installed is announced as a `REPRO_PLUGIN {"installed": ...}` line, and only then; a hook that
could not be installed is a `REPRO_PLUGIN {"error": ...}` line (the gate turns either into the case's verdict). The
counters (COUNTERS) are printed at exit as `REPRO_COUNTERS <json>`; the gate process prints them with the engine's
configuration after generate (repro.vllm_integration.gate). Written against the names in
vllm/v1/attention/backends/flash_attn.py; anything not found is reported, never guessed."""

from __future__ import annotations

import atexit
import copy
import functools
import json
import os
import sys
import zlib
from dataclasses import dataclass, field
from typing import Any

from repro.channel import emit
from repro.tags import AUDIT_TAG, COUNTERS_TAG, PLUGIN_TAG
from repro.vllm_integration.audit import FreshnessAuditor

ENV, FILE_ENV, PROBE_ENV = "REPRO_AUDIT", "REPRO_AUDIT_FILE", "REPRO_PROBE"
SM_MARGIN_ENV, POISON_ENV, WEIGHTS_ENV = "REPRO_SM_MARGIN", "REPRO_POISON", "REPRO_WEIGHTS"
AUDITOR = FreshnessAuditor()
_installed: set[str] = set()
UNKNOWN_KIND = "unknown kind"


def new_counters() -> dict[str, Any]:
    return {
        "captures": {},  # graph kind -> CUDA graph captures seen
        "captures_with_attention": {},  # kind -> captures an attention forward ran in (FULL graphs)
        "captures_audited": {},  # kind -> captures whose attention metadata the auditor checked at capture end
        "captures_stale": {},  # kind -> of those, captures with stale views
        "checks": 0,  # auditor checks (eager forwards and capture ends)
        "views_checked": 0,  # views compared over those checks
        "attention_forwards": 0,  # FlashAttentionImpl.forward calls, eager and captured
        "fa_versions": {},  # FA version of the impl ("3", or "unknown") -> forwards
        "sched_calls": 0,  # get_scheduler_metadata calls (fa3 hooks installed)
        "sched_sm_margin": 0,  # ... that received the injected sm_margin
        "fwd_sm_margin": 0,  # torch.ops._vllm_fa3_C.fwd calls that received it
        "poison_calls": 0,  # scheduler-metadata buffers poisoned
        "entries_poisoned": 0,  # entries filled over all of them
        "runner": None,  # module.Class of the model runner seen on a capture's call stack
    }


COUNTERS: dict[str, Any] = new_counters()


def snapshot() -> dict[str, Any]:
    """The counters as they are now (the auditor's check and view counts folded in)."""
    out = copy.deepcopy(COUNTERS)
    out["checks"], out["views_checked"] = AUDITOR.checks, AUDITOR.views
    out["installed"] = sorted(_installed)
    return out


def _bump(name: str, key: str | None = None, n: int = 1) -> None:
    if key is None:
        COUNTERS[name] += n
    else:
        COUNTERS[name][key] = COUNTERS[name].get(key, 0) + n


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
    emit(tag, obj)  # the structured channel (repro.channel); a tagged line when the process has none


# --- CUDA graph captures and their kind ---------------------------------------------------------------------------


@dataclass
class _Capture:
    kind: str
    forwards: int = 0
    metadata: dict[int, Any] = field(default_factory=dict)  # id -> the metadata objects its attention forwards used


_CAPTURES: list[_Capture] = []
_AUDIT_ON = {"on": False}


def graph_kind(frame: Any, depth: int = 40) -> str:
    """The kind of the CUDA graph a capture records, from the vLLM objects on its call stack: the graph manager
    (a `self` whose class name has CudaGraphManager), the attribute its owner keeps it under (prefill_cudagraph_manager,
    decode_cudagraph_manager, cudagraph_manager), the progress-bar text vLLM passes (`desc`, `progress_bar_desc`) and
    whether a speculator (a spec_decode module, a Speculator/Eagle/Drafter/Proposer class) is on the stack. Also
    records the model runner's class. UNKNOWN_KIND when nothing on the stack says."""
    mgr, attr, texts, draft, seen_vllm = None, None, [], False, False
    f = frame
    for _ in range(depth):
        if f is None:
            break
        mod = str(f.f_globals.get("__name__", ""))
        seen_vllm = seen_vllm or mod.startswith("vllm")
        loc = f.f_locals
        obj = loc.get("self")
        cls = type(obj).__name__ if obj is not None else ""
        if "spec_decode" in mod or any(w in cls for w in ("Speculator", "Eagle", "Drafter", "Proposer")):
            draft = True
        for k in ("progress_bar_desc", "desc"):
            if isinstance(loc.get(k), str):
                texts.append(loc[k])
        if cls.endswith("ModelRunner") and COUNTERS["runner"] is None:
            COUNTERS["runner"] = f"{type(obj).__module__}.{cls}"
        if obj is not None and mgr is None and "CudaGraphManager" in cls:
            mgr = obj
        elif obj is not None and mgr is not None and attr is None and obj is not mgr:
            try:
                attr = next((k for k, v in vars(obj).items() if v is mgr), None)
            except TypeError:
                pass
        f = f.f_back
    if mgr is None and not texts and not seen_vllm:
        return UNKNOWN_KIND
    words = [w.lower() for w in (attr or "", *texts, type(mgr).__name__ if mgr is not None else "")]
    phase = next((p for w in words for p in ("prefill", "decode", "mixed") if p in w), None)
    if draft:
        return f"draft {phase}" if phase in ("prefill", "decode") else f"draft ({UNKNOWN_KIND})"
    if mgr is None and not texts:
        return UNKNOWN_KIND
    return f"target {phase}" if phase else f"target ({UNKNOWN_KIND})"


def install_capture_tracker(cuda: Any) -> None:
    """Wrap torch.cuda.graph (`cuda` is torch.cuda, or a stand-in): count every capture by kind, collect the
    attention metadata its forwards use, and audit that metadata when the capture ends."""
    orig = cuda.graph
    if getattr(orig, "_repro_tracked", False):
        return

    class graph(orig):  # type: ignore[misc,valid-type]
        _repro_tracked = True

        def __enter__(self):
            _CAPTURES.append(_Capture(graph_kind(sys._getframe(1))))
            try:
                return super().__enter__()
            except BaseException:
                _finish_capture(_CAPTURES.pop(), failed=True)
                raise

        def __exit__(self, *exc: Any):
            try:
                return super().__exit__(*exc)
            finally:
                _finish_capture(_CAPTURES.pop(), failed=exc[0] is not None)

    graph.__name__, graph.__qualname__, graph.__doc__ = orig.__name__, orig.__qualname__, orig.__doc__
    cuda.graph = graph


def _finish_capture(cap: _Capture, failed: bool) -> None:
    _bump("captures", cap.kind)
    if cap.forwards:
        _bump("captures_with_attention", cap.kind)
    if failed or not _AUDIT_ON["on"]:
        return
    known = [md for key, md in cap.metadata.items() if AUDITOR.knows(key)]
    stale = False
    for md in known:
        for m in AUDITOR.check(id(md), _views(md)):
            stale = True
            _emit({"stale": m.to_dict(), "message": str(m), "capture": cap.kind})
    if known:
        _bump("captures_audited", cap.kind)
    if stale:
        _bump("captures_stale", cap.kind)


def _wrap_forward(impl_cls: Any) -> None:
    """Count every FlashAttentionImpl.forward (and its FA version); with the auditor on, check the metadata of every
    eager forward, and hand a capture's metadata to that capture."""
    if getattr(impl_cls.forward, "_repro_wrapped", False):
        return
    orig_forward = impl_cls.forward

    def forward(
        self, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any, attn_metadata: Any, *a: Any, **k: Any
    ):
        _bump("attention_forwards")
        version = getattr(self, "vllm_flash_attn_version", None)
        _bump("fa_versions", str(version) if version is not None else "unknown")
        if _CAPTURES:
            cap = _CAPTURES[-1]
            cap.forwards += 1
            if attn_metadata is not None:
                cap.metadata.setdefault(id(attn_metadata), attn_metadata)
        elif _AUDIT_ON["on"] and attn_metadata is not None and not _capturing():
            for m in AUDITOR.check(id(attn_metadata), _views(attn_metadata)):
                _emit({"stale": m.to_dict(), "message": str(m)})
        return orig_forward(self, layer, query, key, value, kv_cache, attn_metadata, *a, **k)

    forward._repro_wrapped = True  # type: ignore[attr-defined]
    impl_cls.forward = forward


def install_probe(module: Any, cuda: Any = None) -> bool:
    """The coverage counters on a flash_attn backend module (and torch.cuda, or a stand-in). False (and an error
    line) when the backend's FlashAttentionImpl is not there."""
    impl_cls = getattr(module, "FlashAttentionImpl", None)
    if impl_cls is None or not callable(getattr(impl_cls, "forward", None)):
        _emit({"error": f"{module.__name__}: FlashAttentionImpl.forward not found: nothing to count"}, PLUGIN_TAG)
        return False
    if cuda is None:
        import torch

        cuda = torch.cuda
    if getattr(cuda, "graph", None) is None:
        _emit({"error": "torch.cuda.graph not found: CUDA graph captures cannot be counted"}, PLUGIN_TAG)
        return False
    _wrap_forward(impl_cls)
    install_capture_tracker(cuda)
    _installed.add("probe")
    return True


def install(module: Any, cuda: Any = None) -> bool:
    """Install the freshness auditor on a flash_attn backend module (passed in so tests can hand it a stand-in).
    False, with a REPRO_PLUGIN error line, when the backend's classes are not there."""
    builder_cls = getattr(module, "FlashAttentionMetadataBuilder", None)
    impl_cls = getattr(module, "FlashAttentionImpl", None)
    if builder_cls is None or impl_cls is None:
        _emit({"error": f"{module.__name__}: FlashAttentionMetadataBuilder/FlashAttentionImpl not found"}, PLUGIN_TAG)
        return False
    orig_build = builder_cls.build

    def build(self, *args: Any, **kwargs: Any):
        md = orig_build(self, *args, **kwargs)
        shape = _shape(md)
        shape["head_dim"] = getattr(self, "headdim", 128)
        AUDITOR.record_build(id(md), _label(md), _views(md), shape)
        return md

    builder_cls.build = build
    _wrap_forward(impl_cls)
    if cuda is not None:
        install_capture_tracker(cuda)
    _AUDIT_ON["on"] = True
    _installed.add("audit")
    return True


def install_fa3_hooks(module: Any, ops: Any, sm_margin: int = 0, poison: Any = None) -> list[str]:
    """sm_margin and/or poison in vLLM's FA3 calls. `module` is the backend module holding the name
    get_scheduler_metadata (vLLM imports it into flash_attn.py); `ops` is torch.ops._vllm_fa3_C. Returns what it did;
    a hook it could not install is an error line (REPRO_PLUGIN)."""
    done = []
    orig_sched = getattr(module, "get_scheduler_metadata", None)
    if orig_sched is None:
        _emit({"error": f"{module.__name__}: get_scheduler_metadata not found"}, PLUGIN_TAG)
        return done

    @functools.wraps(orig_sched)
    def get_scheduler_metadata(*args: Any, **kwargs: Any):
        _bump("sched_calls")
        if sm_margin:
            kwargs["sm_margin"] = sm_margin
            _bump("sched_sm_margin")
        md = orig_sched(*args, **kwargs)
        if poison is not None and md is not None:
            n = _poison_padding(md, poison, kwargs)
            if n is not None:
                _bump("poison_calls")
                _bump("entries_poisoned", n=n)
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
            _bump("fwd_sm_margin")
            return fwd(*args, **kwargs)

        ops.fwd = fwd_with_margin
        done.append(f"_vllm_fa3_C.fwd sm_margin={sm_margin} (argument {idx})")
    return done


def _poison_padding(md: Any, poison: Any, kwargs: dict) -> int | None:
    """Fill the never-written entries; how many (None, and an error line, when the layout is not known)."""
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
        return None
    return poison.apply(md, lay)


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
    _emit(
        {
            "summary": AUDITOR.report(),
            "checks": AUDITOR.checks,
            "views": AUDITOR.views,
            "stale": len(AUDITOR.mismatches),
        }
    )
    if path:
        with open(path, "w") as f:
            json.dump(
                {
                    "checks": AUDITOR.checks,
                    "views": AUDITOR.views,
                    "mismatches": [m.to_dict() for m in AUDITOR.mismatches],
                    "summary": AUDITOR.report(),
                    "counters": snapshot(),
                },
                f,
                indent=1,
            )


def _write_counters() -> None:
    _emit(snapshot(), COUNTERS_TAG)


def requested(environ: dict[str, str] | None = None) -> dict[str, Any]:
    """The features the environment asks for, validated (bad values raise ValueError naming the variable)."""
    from repro.poison import parse_poison

    env = os.environ if environ is None else environ
    out: dict[str, Any] = {"audit": env.get(ENV) == "1"}
    out["probe"] = out["audit"] or env.get(PROBE_ENV) == "1"
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
    """vLLM calls this in every process it starts (general plugins). A feature is announced as installed only when
    every hook it needs went in; otherwise its error line says what was missing."""
    try:
        want = requested()
    except Exception as e:  # a bad variable must be visible, not silently ignored
        _emit({"error": str(e)}, PLUGIN_TAG)
        return
    if not (want["probe"] or want["sm_margin"] or want["poison"] or want["weights"]):
        return
    try:
        from vllm.v1.attention.backends import flash_attn
    except ImportError as e:
        _emit({"error": f"cannot import vLLM's FlashAttention backend: {e}"}, PLUGIN_TAG)
        return
    if want["probe"] and "probe" not in _installed:
        if install_probe(flash_attn):
            atexit.register(_write_counters)
            _emit({"installed": "probe"}, PLUGIN_TAG)
    if want["audit"] and "audit" not in _installed:
        if install(flash_attn):
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
        expected = 1 + bool(want["sm_margin"])
        if len(done) == expected:
            _installed.add("fa3")
            _emit({"installed": "fa3", "hooks": done}, PLUGIN_TAG)
    if want["weights"] and "weights" not in _installed:
        from vllm.model_executor.model_loader import dummy_loader

        loader = getattr(dummy_loader, "DummyModelLoader", None)
        if loader is None or not callable(getattr(loader, "load_weights", None)):
            _emit({"error": f"{dummy_loader.__name__}: DummyModelLoader.load_weights not found"}, PLUGIN_TAG)
            return
        install_margin_weights(loader)
        _emit({"installed": "weights"}, PLUGIN_TAG)
