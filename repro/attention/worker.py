"""Runs ONE case inside its own process (a memory error poisons the CUDA context): `python -m repro.attention.worker SPEC`
(a spec-decode case: `python -m repro.specdecode.worker SPEC`, the layer above, through this module's main).

Prints progress lines `REPRO_PASS <json>` before every launch (so a crash or hang names its descriptor) and one
`REPRO_RESULT <json>` at the end. The parent (repro.run.runner) adds the process-level verdict."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from repro.attention.builder import MetadataBuilder
from repro.attention.reference import paged_attention_reference, tolerance
from repro.attention.staleness import add_counts, diff_snapshots, summarize
from repro.backends import load_backend
from repro.case.poison import parse_poison
from repro.case.scenarios import CAPTURE, SPEC, WARMUP, passes_for
from repro.case.spec import CaseSpec, mps_sm_mismatch
from repro.contract.channel import emit
from repro.contract.tags import DEVICE_TAG, FIRST_STALE, PASS_TAG, RESULT_TAG, SKIP_TAG
from repro.errors import BackendUnavailable, Unavailable


def sm_setup(spec: CaseSpec, torch) -> tuple[int, int, object | None]:
    """(SMs the device reports, sm_margin to pass to FA3, green-context stream or None)."""
    props = torch.cuda.get_device_properties(0)
    reported = props.multi_processor_count
    if spec.sm.kind == "sm_margin":
        if spec.sm.sms > reported:
            raise Unavailable(f"asked for {spec.sm.sms} SMs but the device has {reported}")
        return reported, reported - spec.sm.sms, None
    if why := mps_sm_mismatch(spec.sm, reported):
        raise RuntimeError(why)
    if spec.sm.kind == "green":
        try:
            from torch.cuda import green_contexts  # only for a green case: a torch without them runs every other case
        except ImportError as e:
            raise Unavailable(f"torch {torch.__version__} has no green contexts") from e
        ctx = green_contexts.GreenContext.create(spec.sm.sms, 0)
        ctx.set_context()
        return reported, 0, ctx
    return reported, 0, None


def run_case(spec: CaseSpec) -> dict:
    """One attention-layer case of any scenario but the spec-decode one (repro.specdecode.worker runs that)."""
    import torch  # main imported (and timed) it before this runs: bound here, the module loads without torch

    if spec.scenario == SPEC:
        raise ValueError("a spec-decode case runs in repro.specdecode.worker, not in the attention worker")
    torch.manual_seed(spec.seed)
    reported, margin, _green = sm_setup(spec, torch)
    backend = load_backend(spec.backend, spec.backend_path)
    cfg = spec.cfg
    poison = parse_poison(spec.poison)
    dev = torch.device("cuda", 0)
    builder = MetadataBuilder(backend, cfg, dev, sm_margin=margin, poison=poison)
    shadow = MetadataBuilder(backend, cfg, dev, sm_margin=margin, poison=poison)  # fresh reference, own buffers
    pages = builder.num_pages
    k_cache = torch.randn(pages, cfg.page_size, cfg.num_heads_kv, cfg.head_dim, device=dev, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    stage_wanted = WARMUP if spec.mode == "eager" else CAPTURE
    pool = torch.cuda.graph_pool_handle()
    stale_fields: dict[str, int] = {}
    first_diffs: list[str] = []
    first_stale = None  # the descriptor of the first pass that ran on metadata differing from a fresh build
    worst, worst_tol, worst_desc = 0.0, 0.0, None  # the pass closest to (or furthest past) its tolerance
    n_passes = 0
    for p in passes_for(spec.scenario, builder, spec.strategy, spec.pair):
        if p.stage != stage_wanted:
            continue
        d, md = p.descriptor, p.metadata
        fresh = shadow.build(d)
        seen_snap, fresh_snap = md.snapshot(), fresh.snapshot()
        diffs = diff_snapshots(md, seen_snap, fresh_snap)
        add_counts(stale_fields, summarize(diffs))
        first_diffs += [f"{d.label}: {x}" for x in diffs[: max(0, 3 - len(first_diffs))]]
        first_stale = d.label if diffs and first_stale is None else first_stale
        holder = builder.last_build
        emit(
            PASS_TAG,
            {
                "descriptor": d.label,
                "stage": p.stage,
                "view_build": md.build_id,
                "buffer_holds": holder[1].label if holder else None,
                "stale_entries": len(diffs),
                "stale_fields": summarize(diffs),
                "first_diffs": [str(x) for x in diffs[:2]],
            },
        )
        q = torch.randn(d.num_tokens, cfg.num_heads_q, cfg.head_dim, device=dev, dtype=torch.bfloat16)
        out = torch.zeros_like(q)

        if spec.mode == "eager":
            md.launch(backend, q, k_cache, v_cache, out, margin)
        else:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                md.launch(backend, q, k_cache, v_cache, out, margin)
            g.replay()
        torch.cuda.synchronize()
        args = (q, k_cache, v_cache, fresh_snap["query_start_loc"], fresh_snap["seq_lens"], fresh.block_table)
        ref = paged_attention_reference(*args, cfg.causal, cfg.window_left)
        tol = tolerance(ref, paged_attention_reference(*args, cfg.causal, cfg.window_left, upcast=False))
        err = float((out.float() - ref).abs().max().nan_to_num(float("inf")))
        if worst_desc is None or err - tol > worst - worst_tol:
            worst, worst_tol, worst_desc = err, tol, d.label
        n_passes += 1
    return {
        "passes": n_passes,
        "max_abs_err": worst,
        "worst_descriptor": worst_desc,
        "tolerance": worst_tol,
        "wrong": worst > worst_tol,
        "stale_fields": stale_fields,
        "first_diffs": first_diffs,
        FIRST_STALE: first_stale,
        "sms_reported": reported,
        "sms_planned": reported - margin,
        "backend_identity": backend.identity().to_dict(),
    }


def main(argv: list[str] | None = None, run: Callable[[CaseSpec], dict] = run_case) -> int:
    """The case process: its spec from argv (or stdin for "-"), torch and the device record, `run` (this module's
    run_case, or the spec-decode worker's), a skip or the RESULT record with its phases."""
    argv = sys.argv[1:] if argv is None else argv
    spec = CaseSpec.from_json(argv[0] if argv[0] != "-" else sys.stdin.read())
    t0 = time.time()
    try:
        import torch  # torch after t0: its import is part of the timed start (t_import)

        t_import = time.time()
        if not torch.cuda.is_available():
            if os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"):  # the MPS server failed: not a skip
                raise RuntimeError("MPS client found no CUDA device (the MPS server is down or faulted)")
            raise Unavailable("no CUDA device visible to this process")
        torch.cuda.init()
        t_cuda = time.time()
        # where this process runs and how long it took to get there, before any launch: a case that crashes
        # later still names its GPU and has its start-up phases (repro.report.benchmark)
        phases = {"main_at": t0, "import_s": round(t_import - t0, 3), "cuda_init_s": round(t_cuda - t_import, 3)}
        emit(
            DEVICE_TAG,
            {
                "gpu_uuid": str(torch.cuda.get_device_properties(0).uuid),
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "phases": phases,
            },
        )
        res = run(spec)
    except (BackendUnavailable, Unavailable) as e:
        emit(SKIP_TAG, {"reason": str(e)})
        return 0
    t_done = time.time()
    # where a case's time goes, for the benchmark (repro.report.benchmark); the parent adds process start and teardown
    res["phases"] = {**phases, "work_s": round(t_done - t_cuda, 3)}
    res["wall_s"] = round(time.time() - t0, 3)
    res["pid"] = os.getpid()
    emit(RESULT_TAG, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
