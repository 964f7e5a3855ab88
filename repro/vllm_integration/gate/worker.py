"""One gate case process: vLLM's own V2 model runner on a tiny local Llama (no hub: dummy weights redrawn with margins
by the plugin, no tokenizer, token-id prompts), bf16, FLASH_ATTN (FA3 on Hopper), engine in-process.

  python -m repro.vllm_integration.gate.worker      with its request (repro.contract.request.CaseRequest) in
                                                    REPRO_REQUEST, as the gate starts it

What it runs is its request, read once and validated (a key unknown, missing or of another type: BadRequest, exit 1):
the speculative run (its method's draft, 3 speculative tokens, FULL_AND_PIECEWISE CUDA graphs or, with compile
`none`, FULL graphs of the eager model, vLLM's default capture sizes: the configuration under test), or with
`reference` the same prompts and draft, greedy, no CUDA graphs (enforce_eager): the gate's reference for the tokens
(with log-probabilities) and for the draft's acceptance.

Prints `REPRO_DEVICE` (the GPU and the SM count this process sees, and whether bf16 matrix products come out right
there: gemm_check), `REPRO_ENGINE` (the engine's resolved
configuration: model runner, attention backend and FA version, cudagraph mode, speculative method and k; the plugin's
coverage counters; acceptance counts where vLLM exposes them) and `REPRO_RESULT` (tokens; with a reference the top-2
log-probability margin of every generated token) lines; the parent (repro.vllm_integration.gate.run, through
gate_judge) turns the process's output into a verdict. The plugin features (audit, sm_margin, poison, weights) are
the request's plugin part, read by the plugin that vLLM loads through its entry point."""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path

from repro.contract import request
from repro.contract.channel import emit
from repro.contract.tags import DEVICE_TAG, ENGINE_TAG, PLUGIN_TAG, RESULT_TAG
from repro.files import write_whole
from repro.run import own_alloc
from repro.vllm_integration.gate import sleep
from repro.vllm_integration.gate.methods import DEFAULT_METHOD, DRAFT, TABLE, TARGET  # noqa: F401  TARGET, DRAFT: re-exported
from repro.vllm_integration.plugin.backend_fields import DEFAULT_BACKEND
from repro.vllm_integration.releases.builds import add_site_dirs

# the models of each speculative method: repro.vllm_integration.gate.methods (TARGET and DRAFT are EAGLE's)
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23], [31, 32, 33, 34, 35], [41, 42, 43, 44]]
KV_CACHE_BYTES = 1 << 30
SPEC_TOKENS = 3
# how the speculative run compiles: "inductor" (vLLM's default, VLLM_COMPILE: torch.compile and inductor, piecewise and
# FULL graphs) or "none" (compilation mode 0: FULL CUDA graphs of the eager model, the draft's included, and no compile
# time: results/h200-fast-cold, h200-fast-warm, h200-compile-none)
COMPILES = ("inductor", "none")
DEFAULT_COMPILE = "inductor"
MAX_NEW = 16
GPU_MEMORY = 0.1  # share of GPU memory that must be free at start


def write_models(root: str | Path, method: str = DEFAULT_METHOD) -> tuple[Path, Path | None]:
    """The method's target and draft model folders (config.json each; no draft folder for MTP, whose draft is the
    target's own layer) under root; a config already there with the same text is left alone, a changed one replaced
    whole (one rename): concurrent cases may share the folder. vLLM's compile-cache key includes the model's path, so
    the cases of one build share one folder (the gate cache's); the methods share the Llama target's."""
    root = Path(root)
    paths = []
    for name, cfg in TABLE[method].models():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        text = json.dumps(cfg, indent=1)
        cfg_file = d / "config.json"
        if not cfg_file.exists() or cfg_file.read_text() != text:
            write_whole(cfg_file, text)
        paths.append(d)
    return paths[0], (paths[1] if len(paths) > 1 else None)


def llm_kwargs(
    target: Path,
    draft: Path | None,
    reference: bool,
    spec_tokens: int,
    gpu_memory: float,
    backend: str = DEFAULT_BACKEND,
    compile: str = DEFAULT_COMPILE,
    method: str = DEFAULT_METHOD,
) -> dict:
    """The LLM(...) arguments of a gate run. Reference: the same speculative decoding, no CUDA graphs. `compile`: one of
    COMPILES (the reference never compiles); `method`: one of gate.methods.METHODS."""
    if compile not in COMPILES:
        raise ValueError(f"compile {compile!r}: expected one of {', '.join(COMPILES)}")
    kw = dict(
        model=str(target),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=1024,
        gpu_memory_utilization=gpu_memory,
        # a fixed KV cache skips vLLM's memory profiling, whose check fails when a concurrent case frees memory
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        attention_backend=backend,
        seed=0,
    )
    kw["disable_log_stats"] = False  # LLM.get_metrics(): the speculative-decoding acceptance counters
    kw["speculative_config"] = TABLE[method].speculative_config(draft, spec_tokens, backend)
    kw.update(sleep.engine_kwargs(TABLE[method].sleep_level, reference))  # a sleep-and-wake scenario's (gate.sleep)
    if reference:
        kw["enforce_eager"] = True
    elif compile == "none":
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL"}
    else:
        kw["compilation_config"] = {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    return kw


# the projections of the gate's model, and one of 19 rows (the four prompts' prefill): shapes that came out wrong under
# MPS at 24 SMs on the H200 (results/h200-mps-gemm-probe)
GEMM_SHAPES = ((19, 1024, 1536), (19, 1024, 4096), (4, 1024, 1536), (19, 2048, 1024))
GEMM_TOLERANCE = 0.1  # |GPU - float32| for bf16 inputs with these sizes: about 0.01; a wrong product: several units


def gemm_check() -> dict:
    """bf16 matrix products on this process's GPU against float32 on the CPU (the same bf16-rounded inputs): whether
    the platform in this SM configuration computes them right. {"max_error", "tolerance", "ok", "worst"}."""
    import torch  # main imported (and timed) it before this runs: bound here, the module loads without torch

    g = torch.Generator().manual_seed(0)
    worst, err = None, 0.0
    for m, k, n in GEMM_SHAPES:
        a = torch.randn(m, k, generator=g).bfloat16()
        b = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
        got = (a.cuda() @ b.cuda().T).float().cpu()
        e = float((got - a.float() @ b.float().T).abs().max())
        if not math.isfinite(e) or e > err:
            err, worst = (e if math.isfinite(e) else float("inf")), f"{m}x{k}x{n}"
    return {"max_error": round(err, 4), "tolerance": GEMM_TOLERANCE, "ok": err <= GEMM_TOLERANCE, "worst": worst}


def _logprob_values(logprobs: dict | None) -> list[float]:
    return [float(lp.logprob if hasattr(lp, "logprob") else lp) for lp in (logprobs or {}).values()]


def top2_margin(logprobs: dict | None) -> float | None:
    """log p(top-1) - log p(top-2) at one position, from vLLM's per-token logprobs dict (None when absent or not
    finite: NaN logits give NaN log-probabilities, and a NaN margin must never read as a decided token)."""
    vals = _logprob_values(logprobs)
    if len(vals) < 2 or not all(math.isfinite(v) for v in vals):
        return None
    vals.sort(reverse=True)
    return round(vals[0] - vals[1], 5)


def nonfinite_positions(outputs) -> list[str]:
    """Positions whose returned log-probabilities are not all finite ("request i token j"): the logits were NaN or
    inf there (a reference that must not be trusted)."""
    bad = []
    for i, o in enumerate(outputs):
        for j, lp in enumerate(o.outputs[0].logprobs or []):
            vals = _logprob_values(lp)
            if not vals or not all(math.isfinite(v) for v in vals):
                bad.append(f"request {i} token {j}")
    return bad


def _name(x) -> str | None:
    if x is None:
        return None
    return str(getattr(x, "name", None) or x)


def _backend_seen(counters: dict) -> str | None:
    """The attention backend whose forwards the plugin counted most (its `backends` counter), None when none ran."""
    seen = {k: v for k, v in (counters.get("backends") or {}).items() if v}
    if seen:
        return max(seen, key=seen.get)
    return "FLASH_ATTN" if counters.get("attention_forwards") else None  # a plugin that counts FA forwards only


def resolved_engine(llm) -> dict:
    """What the engine resolved, read from its config after start-up (in-process engine: the config the model runner
    updated) and from the plugin's counters (the attention impl that ran, its FA version, the runner seen capturing).
    A value vLLM does not expose here is None, never guessed."""
    from repro.vllm_integration.plugin.counters import (
        snapshot,  # the plugin's counters: only the case process reads them
    )

    counters = snapshot()
    engine = getattr(llm, "llm_engine", None)
    cfg = getattr(engine, "vllm_config", None)
    comp = getattr(cfg, "compilation_config", None)
    spec = getattr(cfg, "speculative_config", None)
    attn_cfg = getattr(cfg, "attention_config", None)
    runner = counters.get("runner")
    if runner is None:  # no capture put the runner on the stack: the module the worker imported
        for mod in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"):
            if mod in sys.modules:
                runner = f"{mod} (imported; no capture seen)"
                break
    versions = counters.get("fa_versions") or {}
    return {
        "model_runner": runner,
        "model_runner_v2": bool(runner) and str(runner).startswith("vllm.v1.worker.gpu."),
        "attention_backend_requested": _name(getattr(attn_cfg, "backend", None)),
        "attention_backend": _backend_seen(counters),
        "fa_version": next(iter(versions)) if len(versions) == 1 else (sorted(versions) or None),
        "cudagraph_mode": _name(getattr(comp, "cudagraph_mode", None)),
        "compilation_mode": _name(getattr(comp, "mode", getattr(comp, "level", None))),
        "speculative_method": getattr(spec, "method", None) if spec is not None else None,
        "num_speculative_tokens": getattr(spec, "num_speculative_tokens", None) if spec is not None else 0,
        "counters": counters,
    }


def acceptance(llm) -> dict:
    """vLLM's speculative-decoding counters (LLM.get_metrics, with stats logging on), or why they are not there."""
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # old vLLM, stats off: said, not guessed
        return {"unavailable": f"{type(e).__name__}: {e}"[:200]}
    out = {}
    for m in metrics:
        name = str(getattr(m, "name", ""))
        if "spec_decode" not in name:
            continue
        value = getattr(m, "value", None)
        out[name.removeprefix("vllm:")] = value if value is not None else getattr(m, "values", None)
    return out or {"unavailable": "no spec_decode metric in LLM.get_metrics()"}


INSPECT_ENV = (
    "REPRO_GATE_INSPECT"  # "vllm": leave vLLM's registry inspection as it is (the gate reads it: vllm_inspects)
)


def inspect_in_process(vllm_inspects: bool = False) -> str:
    """Where vLLM inspects the model classes it has no cached record of. vLLM runs each inspection in a fresh
    interpreter (registry._run_in_subprocess: `python -m vllm.model_executor.models.registry`, which imports torch and
    vLLM again) so that its caller never starts CUDA; on an empty cache folder that is 20-24 s each, for the target and
    for the draft: 44 s of every cold case (results/h200-fast-cold, phase `config`). A gate case process starts CUDA
    itself a moment later, so here the inspection runs in this process, on the vLLM it already imported; what it
    returns (the class's _ModelInfo) and the cache record vLLM writes from it are the same. Returns how it runs:
    "in-process", or "vLLM's own process" with why (the request's vllm_inspects: REPRO_GATE_INSPECT=vllm in the
    gate's environment, or a registry without that function), for the ENGINE record."""
    if vllm_inspects:
        return f"vLLM's own process ({INSPECT_ENV}=vllm)"
    try:
        from vllm.model_executor.models import registry  # vLLM in the case process only
    except ImportError as e:  # a layout without that module: vLLM inspects as it does
        return f"vLLM's own process (vllm.model_executor.models.registry: {e})"[:200]
    if not callable(getattr(registry, "_run_in_subprocess", None)):
        return "vLLM's own process (its registry has no _run_in_subprocess)"
    registry._run_in_subprocess = lambda fn: fn()
    return "in-process"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m repro.vllm_integration.gate.worker",
        description=f"one gate case: what it runs is its request, in {request.ENV} (repro.contract.request)",
    )
    p.parse_args(argv)
    req = request.read()
    if req is None:
        p.error(f"no request: {request.ENV} is not set (the gate sets it: repro.vllm_integration.gate.case.case_env)")
    t0 = time.time()
    sites = add_site_dirs()  # the build's prefixes as site folders: their .pth files take effect, as in that env
    import torch  # torch after t0: the import is part of the timed start (timing_s)

    own = req.own_alloc
    if own:  # memcheck:own: torch's allocator is replaced before anything starts CUDA
        emit(PLUGIN_TAG, own_alloc.install(own, req.own_alloc_fill))
    t_torch = time.time()
    device = None
    if torch.cuda.is_available():
        prop = torch.cuda.get_device_properties(0)
        device = {"gpu": prop.name, "sms": prop.multi_processor_count, "gemm_check": gemm_check()}
    t_cuda = time.time()
    import vllm  # vLLM in the case process only: the parent never needs it
    from vllm import LLM, SamplingParams  # imported here: the parent never needs vllm

    t_import = time.time()
    # the start-up split (imports against CUDA's start and the GEMM check): in the DEVICE record too, so a case that
    # crashes later still shows it (gate_bench.phases); ~0 s of import in a case forked from a forkserver
    startup = {
        "torch_import": round(t_torch - t0, 2),
        "cuda_init": round(t_cuda - t_torch, 2),
        "vllm_import": round(t_import - t_cuda, 2),
    }
    if device is not None:
        device["startup_s"] = startup
        emit(DEVICE_TAG, device)
    target, draft = write_models(req.models, req.method)
    inspection = inspect_in_process(req.vllm_inspects)
    own_before = own_alloc.counters() if own else {}  # the GEMM check's allocations are not vLLM's
    backend = req.plugin.attention_backend
    llm = LLM(**llm_kwargs(target, draft, req.reference, SPEC_TOKENS, GPU_MEMORY, backend, req.compile, req.method))
    from repro.vllm_integration.plugin import counters  # the counters the case reports: whether it slept

    sleep.sleep_and_wake(llm, TABLE[req.method].sleep_level, req.reference, counters.COUNTERS)
    t_engine = time.time()
    params = SamplingParams(
        temperature=0.0, max_tokens=MAX_NEW, detokenize=False, ignore_eos=True, logprobs=2 if req.reference else None
    )
    outs = llm.generate([{"prompt_token_ids": t} for t in PROMPTS], params)
    t_done = time.time()
    if own:
        now = own_alloc.counters()  # coverage: vLLM's tensors and graphs went through it
        counters.COUNTERS["own_allocator"] = {
            **now,
            "engine_allocations": now["allocations"] - own_before["allocations"],
        }
    engine = resolved_engine(llm)  # the reference's too: the configuration it ran with is part of its validation
    engine["acceptance"] = acceptance(llm)
    engine["model_inspection"] = inspection
    engine["method"] = req.method
    engine["site_dirs"] = sites
    emit(ENGINE_TAG, engine)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    margins = [[top2_margin(lp) for lp in (o.outputs[0].logprobs or [])] for o in outs] if req.reference else None
    result = {
        "vllm_version": vllm.__version__,
        "reference": req.reference,
        "tokens": tokens,
        "margins": margins,
        "nonfinite": nonfinite_positions(outs) if req.reference else None,
        "device": device,
        "timing_s": {
            "import": round(t_import - t0, 1),
            **startup,
            "engine": round(t_engine - t_import, 1),
            "generate": round(t_done - t_engine, 1),
            "main_at": round(t0, 3),  # epoch s: the parent adds process start and teardown (gate_bench.phases)
            "done_at": round(time.time(), 3),
        },
        "summary": f"{len(tokens)} requests x {MAX_NEW} tokens decoded",
    }
    emit(RESULT_TAG, result)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
    code = main()
    # the interpreter's last collection would walk every object torch and vLLM made (0.5 s of each spawned case's
    # end on CPU); the atexit handlers (the plugin's exit reports) still run, and records are written unbuffered
    gc.freeze()
    sys.exit(code)
