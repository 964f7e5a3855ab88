"""What FA3's main and split-KV combine kernels read, given a metadata view, the launch's host parameters and the
allocation sizes: a predicted verdict per launch.

Modelled exactly: the combine kernel's split loop (bounded by the compile-time kMaxSplits, not by the launch's S)
over fp32 lse_accum [S, H, total_q] and out_accum [S, H, total_q, dv], both sized from the HOST parameters.
Flagged as risks (what the main kernel does with them is not modelled): out-of-range batch indices, zero or huge
values, a nonzero semaphore, zero heads in L2."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from repro.backends.layout import SEMAPHORE, MetadataLayout
from repro.contract.verdicts import CLEAN, OOB, WRONG

HUGE = 1 << 20  # a metadata value this large cannot describe a real batch


def combine_max_splits(num_splits: int, head_dim_v: int) -> int:
    """kMaxSplits of the combine kernel run_mha_fwd_combine_ picks for S splits."""
    block_k = 64 if head_dim_v <= 64 else 128
    block_m = 8 if block_k % 128 == 0 else (16 if block_k % 64 == 0 else 32)
    if block_m >= 16 and num_splits <= 16:
        return 16
    for cap in (32, 64, 128):
        if num_splits <= cap:
            return cap
    return 256


@dataclass
class Prediction:
    verdict: str  # clean | wrong-output | oob
    kernel: str | None = None  # combine | main
    reason: str = ""
    buffer: str | None = None  # the allocation read past
    byte_range: tuple[int, int] | None = None  # [first, last) byte offsets read, relative to its start
    alloc_bytes: int | None = None
    flags: list[str] = field(default_factory=list)
    # differing entries per field (buffer or decoded metadata field) over the passes up to the deciding one, as a GPU
    # run's CaseResult.stale_fields counts them; predict_case fills it
    stale_fields: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


ALLOCATOR_SEGMENT = 2 << 20  # PyTorch's caching allocator hands out 2 MiB segments: smaller over-reads stay inside


def predict_launch(
    view: list[int],
    layout: MetadataLayout,
    launch_splits: int,
    num_heads_q: int,
    head_dim: int,
    total_q: int,
    query_start_loc: list[int],
    stale_entries: int,
    sanitizer: bool = True,
) -> Prediction:
    """Predict one forward. `view` holds the scheduler-metadata view's contents, decoded at the LAUNCH layout
    (the one the kernels use); `launch_splits` is the S the host resolved for the launch."""
    dec = layout.decode(view)
    b = layout.batch
    flags: list[str] = []
    nsd = dec.get("num_splits_dynamic")
    for name, vals in dec.items():
        if name == SEMAPHORE:
            if vals[0] != 0:
                flags.append(f"semaphore {vals[0]} on entry (must be 0)")
            continue
        if any(v >= HUGE or v < 0 for v in vals):
            flags.append(f"{name} holds values no batch has ({min(vals)}..{max(vals)})")
    if "varlen_batch_idx" in dec and any(not 0 <= v < b for v in dec["varlen_batch_idx"]):
        flags.append("varlen_batch_idx points past the batch")
    if "num_nheads_in_l2" in dec and 0 in dec["num_nheads_in_l2"]:
        flags.append("num_nheads_in_l2 has zeros")
    if nsd is not None and 0 in nsd:
        flags.append("num_splits_dynamic has zeros: tiles skipped")
    outside = any("values no batch has" in f or "past the batch" in f for f in flags)
    main_fault = Prediction(OOB, "main", "metadata values outside any batch: " + "; ".join(flags), flags=flags)
    # vLLM's fork: values that describe no batch send its main kernel out of bounds first (observed, both fills).
    if outside and layout.flavor == "vllm":
        return main_fault
    if nsd is not None and launch_splits > 1:
        kmax = combine_max_splits(launch_splits, head_dim)
        over = [(vb, v) for vb, v in enumerate(nsd) if v > launch_splits]
        read_to = min(max((v for _, v in over), default=0), kmax)
        if over and read_to > launch_splits:
            plane = num_heads_q * total_q * 4
            vb, v = over[0]
            # Observed on the H200 (results/model-agreement.md): vLLM's fork faults in the MAIN kernel first (it
            # writes split partials past S); upstream's main kernel skips splits without KV blocks and its combine
            # over-reads. Not derived from the main kernel's source: an empirical rule.
            kernel = "main" if layout.flavor == "vllm" else "combine"
            access = "writes split partials" if kernel == "main" else "reads splits"
            pred = Prediction(
                OOB,
                kernel,
                f"virtual batch {vb}: num_splits_dynamic {v} > launch S={launch_splits}; the {kernel} kernel {access} "
                f"[{launch_splits}, {read_to}) past fp32 lse_accum of {launch_splits * plane} bytes",
                "lse_accum",
                (launch_splits * plane, read_to * plane),
                launch_splits * plane,
                flags,
            )
            if not sanitizer and read_to * plane - launch_splits * plane < ALLOCATOR_SEGMENT:
                if outside:  # the over-read stays hidden, the main kernel's wild values do not
                    return main_fault
                pred.verdict = WRONG
                pred.reason += "; hidden by the caching allocator without memcheck"
            return pred
        if over:
            flags.append(f"num_splits_dynamic up to {max(v for _, v in over)} > S={launch_splits} (= kMaxSplits)")
    # Upstream: the combine over-read above is seen first when S < kMaxSplits; otherwise the main kernel faults.
    if outside:
        return main_fault
    if stale_entries:
        return Prediction(WRONG, None, f"{stale_entries} entries differ from a fresh build", flags=flags)
    return Prediction(CLEAN, None, "metadata equals a fresh build", flags=flags)
