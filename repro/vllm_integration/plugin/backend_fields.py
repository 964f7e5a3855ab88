"""Which attention metadata the freshness auditor checks, per vLLM attention backend: where each backend lives, how
its classes are found, and a table of its metadata fields, each either checked (with what it holds) or excluded
(with why), read from vLLM 0.23-0.33's sources (vllm/v1/attention/backends/flash_attn.py, triton_attn.py,
flashinfer.py).

The rule behind every table: a tensor a build hands out is checked, because a later build can overwrite it before
the forward that uses it reads it (the defect of vLLM PR #48261); what is excluded is a host-side value fixed at
build (a scalar, a dtype, a host list or dict), a scratch buffer the kernels themselves write at every forward, or a
buffer too large to copy to the host at every forward (a gap the table names). A tensor found in a metadata object
that its backend's table does not list is checked anyway (the rule, not the table, decides) and reported as
unlisted, so a new vLLM field is never silently skipped.

A backend not in BACKENDS is found generically: the module vLLM's registry names for it, one `*MetadataBuilder` with
a `build` and one `*Impl` whose `forward(self, layer, query, key, value, kv_cache, attn_metadata, ...)`; every tensor
of its metadata is checked.

Names: vLLM's AttentionBackendEnum names a backend in upper snake case after its kernels, the family last:
`*_ATTN` (FLASH_ATTN, TRITON_ATTN, ROCM_ATTN, TREE_ATTN, CPU_ATTN), `*_ATTENTION` (FLEX_ATTENTION), `*_MLA`
(TRITON_MLA, CUTLASS_MLA, FLASHINFER_MLA). A name in BACKENDS or of that shape (NAME_CONVENTION) is one the gate can
run (the registry of the build under test decides whether it has it); any other (BOGUS_BACKEND) is refused as a
typo before a case runs (known_name)."""

from __future__ import annotations

import dataclasses
import fnmatch
import inspect
import re
from dataclasses import dataclass, field
from typing import Any

DEFAULT_BACKEND = "FLASH_ATTN"
FORWARD_ARGS = ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata")  # vLLM's names
METADATA_ARG = FORWARD_ARGS.index("attn_metadata")  # the hooks pass arguments by position: this one must be here
MAX_ELEMENTS = 1 << 22  # a tensor larger than this is not copied to the host at every forward (reported, not checked)
MAX_DEPTH = 3  # attribute hops from the metadata object: md.decode.wrapper._paged_kv_indptr_buf

SCALAR = "a host-side scalar fixed at build: no later build can overwrite it"
CASCADE = "cascade attention only: allocated by its build (None under FULL CUDA graphs)"
DRAFT_STEP = "advanced in place between draft steps by the speculator (update_draft_inputs, compute_slot_mappings)"


@dataclass(frozen=True)
class BackendFields:
    name: str  # vLLM's AttentionBackendEnum name
    module: str  # the module holding the builder, the impl and the metadata class
    prefix: str  # class-name prefix: <prefix>MetadataBuilder, <prefix>Impl, <prefix>Metadata
    checked: dict[str, str]  # field path (fnmatch pattern) -> what it holds
    excluded: dict[str, str]  # field path (fnmatch pattern) -> why it is not checked
    # fields an in-graph draft-decode refresh (update_draft_decode_metadata and the draft loop around it) rewrites:
    # inside a capture their contents are the graph's to compute, not the build's
    refreshed_in_graph: dict[str, str] = field(default_factory=dict)

    @property
    def builder(self) -> str:
        return f"{self.prefix}MetadataBuilder"

    @property
    def impl(self) -> str:
        return f"{self.prefix}Impl"

    @property
    def metadata(self) -> str:
        return f"{self.prefix}Metadata"

    def excluded_reason(self, path: str) -> str | None:
        return next((why for pat, why in self.excluded.items() if fnmatch.fnmatchcase(path, pat)), None)

    def listed(self, path: str) -> bool:
        return any(fnmatch.fnmatchcase(path, pat) for pat in self.checked) or self.excluded_reason(path) is not None

    def refreshed(self, path: str, draft_loop: bool = True) -> bool:
        """Does an in-graph refresh rewrite this field? The draft loop's own step (DRAFT_STEP: seq_lens, slot_mapping
        advanced between draft steps) only in a capture that runs a draft loop; a single-forward draft capture
        (DFlash's query graph: update_draft_decode_metadata only) leaves those fields as its build wrote them."""
        return any(
            fnmatch.fnmatchcase(path, pat) and (draft_loop or why != DRAFT_STEP)
            for pat, why in self.refreshed_in_graph.items()
        )


_COMMON_CHECKED = {
    "query_start_loc": "cumulative query lengths: a view of the runner's persistent query_start_loc buffer",
    "seq_lens": "KV lengths per request: a view of the persistent seq_lens buffer",
    "block_table": "page-table rows per request: a view of the persistent block-table buffer",
    "slot_mapping": "the KV-cache slot of each token: a view of the persistent slot-mapping buffer",
    "causal": "per-request causal flags when a tensor (a plain bool otherwise: a scalar)",
    "scheduler_metadata": "AOT scheduler metadata: a view of the builder's persistent buffer under FULL CUDA graphs",
    "prefix_scheduler_metadata": CASCADE,
    "cu_prefix_query_lens": CASCADE,
    "prefix_kv_lens": CASCADE,
    "suffix_kv_lens": CASCADE,
    "mm_prefix_range_tensor": "multimodal prefix-LM ranges per request, built from the batch",
    "rswa_prefix_lens": "R-SWA prompt lengths: a view of the builder's persistent buffer",
}
_COMMON_SCALARS = (
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
    "use_cascade",
    "common_prefix_len",
    "rswa_window",
)
_DRAFT_REFRESH = {"seq_lens": DRAFT_STEP, "slot_mapping": DRAFT_STEP}

FLASH_ATTN = BackendFields(
    name="FLASH_ATTN",
    module="vllm.v1.attention.backends.flash_attn",
    prefix="FlashAttention",
    checked={
        **_COMMON_CHECKED,
        "dcp_context_kv_lens": "decode-context-parallel KV lengths, built from the batch",
        "mm_prefix_query_range_tensor": "multimodal prefix-LM query ranges (0.29 on), built from the batch",
        "rswa_window_tensor": "R-SWA window, allocated by build so forward needs no host copy",
    },
    excluded={
        **{name: SCALAR for name in _COMMON_SCALARS},
        **{
            name: SCALAR
            for name in (
                "max_dcp_context_kv_len",
                "max_num_splits",
                "num_decode_reqs",
                "num_prefill_reqs",
                "num_decode_tokens",
                "num_prefill_tokens",
            )
        },
        "sliding_window": "a host-side (left, right) tuple fixed at build",
    },
    refreshed_in_graph={
        **_DRAFT_REFRESH,
        "scheduler_metadata": "recomputed by FlashAttentionMetadataBuilder.update_draft_decode_metadata",
    },
)

TRITON_ATTN = BackendFields(
    name="TRITON_ATTN",
    module="vllm.v1.attention.backends.triton_attn",
    prefix="TritonAttention",
    checked=dict(_COMMON_CHECKED),
    excluded={
        **{name: SCALAR for name in (*_COMMON_SCALARS, "seq_threshold_3D", "num_par_softmax_segments")},
        "softmax_segm_*": "the 3D decode kernel's scratch (the builder's persistent workspace): written by the "
        "kernel at every forward, outputs rather than metadata",
        "mm_prefix_range": "a host-side dict of lists fixed at build",
    },
    refreshed_in_graph=dict(_DRAFT_REFRESH),  # its update_draft_decode_metadata is a no-op; the draft loop is not
)

_WRAPPER = "FlashInfer's planned index buffer for this batch (persistent under CUDA graphs: views of the builder's)"
FLASHINFER = BackendFields(
    name="FLASHINFER",
    module="vllm.v1.attention.backends.flashinfer",
    prefix="FlashInfer",
    checked={
        "slot_mapping": _COMMON_CHECKED["slot_mapping"],
        "prefill.wrapper._qo_indptr_buf": _WRAPPER,
        "prefill.wrapper._paged_kv_indptr_buf": _WRAPPER,
        "prefill.wrapper._paged_kv_indices_buf": _WRAPPER + "; the whole buffer, not only this batch's pages",
        "prefill.wrapper._paged_kv_last_page_len_buf": _WRAPPER,
        "decode.wrapper._paged_kv_indptr_buf": _WRAPPER,
        "decode.wrapper._paged_kv_indices_buf": _WRAPPER + "; the whole buffer, not only this batch's pages",
        "decode.wrapper._paged_kv_last_page_len_buf": _WRAPPER,
        "prefill.block_tables": "TRTLLM prefill: the prefill requests' block-table rows (a view)",
        "prefill.seq_lens": "TRTLLM prefill: the prefill requests' seq_lens (a view)",
        "prefill.cum_seq_lens_q": "TRTLLM prefill: cumulative query lengths",
        "prefill.cum_seq_lens_kv": "TRTLLM prefill: cumulative KV lengths",
        "decode.block_tables": "TRTLLM/XQA decode: the decode requests' block-table rows (a view)",
        "decode.seq_lens": "TRTLLM/XQA decode: the decode requests' seq_lens (a view)",
        "decode.q_cu_seq_lens": "XQA decode (0.32 on): cumulative query lengths for ragged speculative decode",
        "decode.mask": "XQA decode (0.32 on): the packed draft mask",
        "decode.dcp_query_start_loc": "XQA decode (0.32 on): decode query boundaries for decode context parallel",
    },
    excluded={
        **{
            name: SCALAR
            for name in (
                "num_actual_tokens",
                "num_decodes",
                "num_decode_tokens",
                "num_prefills",
                "num_prefill_tokens",
                "causal",
                "use_cascade",
                "prefill.max_q_len",
                "prefill.max_seq_len",
                "decode.max_seq_len",
            )
        },
        "q_data_type_*": "a dtype fixed at build",
        "q_data_type": "a dtype fixed at build",
        "kv_cache_layout": "a layout name fixed at build",
        "decode.kernel": "an enum naming the decode kernel, fixed at build",
        "*workspace*": "FlashInfer's plan scratch (float workspace of hundreds of MiB, int workspace of 8 MiB and "
        "its pinned host copy): too large to copy at every forward. A gap: the plan's work split lives there",
        "*._plan_info": "the plan's host-side list",
    },
    refreshed_in_graph={
        "slot_mapping": DRAFT_STEP,
        "decode.seq_lens": DRAFT_STEP,
    },
)

BACKENDS: dict[str, BackendFields] = {b.name: b for b in (FLASH_ATTN, TRITON_ATTN, FLASHINFER)}
NAME_CONVENTION = re.compile(r"[A-Z][A-Z0-9]*(?:_[A-Z0-9]+)*_(?:ATTN|ATTENTION|MLA)")  # vLLM's names: the docstring


def known_name(name: str) -> bool:
    """A backend with a table here, or one named as vLLM names its backends (found generically)."""
    return name in BACKENDS or NAME_CONVENTION.fullmatch(name) is not None


def generic(name: str, module: str) -> BackendFields:
    """A backend without a table: every tensor checked, nothing excluded but host-side values."""
    return BackendFields(name=name, module=module, prefix="", checked={}, excluded={})


def backend_for(name: str) -> BackendFields:
    """The table of a backend named as vLLM names it; a backend without one gets its module from vLLM's registry
    (importing vLLM). KeyError, naming the backend, when neither knows it."""
    if name in BACKENDS:
        return BACKENDS[name]
    from vllm.v1.attention.backends.registry import AttentionBackendEnum  # only for a backend without a table

    try:
        path = AttentionBackendEnum[name].value
    except KeyError:
        raise KeyError(f"attention backend {name!r}: not one vLLM's registry knows") from None
    return generic(name, str(path).rsplit(".", 1)[0])


# --- the classes a backend module holds ----------------------------------------------------------------------------


def _forward_ok(impl_cls: Any) -> bool:
    """Does <X>Impl.forward take attn_metadata where vLLM's does (the hook reads it by position)?"""
    try:
        params = list(inspect.signature(impl_cls.forward).parameters)
    except (TypeError, ValueError, AttributeError):
        return False
    return len(params) > METADATA_ARG and params[METADATA_ARG] == "attn_metadata"


def find_classes(module: Any, spec: BackendFields) -> tuple[Any, Any]:
    """(builder class, impl class) of a backend module: the table's names, or for a generic backend the one
    `*MetadataBuilder` with a `build` and the one `*Impl` with vLLM's forward signature. LookupError saying what is
    missing otherwise."""
    name = getattr(module, "__name__", "?")
    if spec.prefix:
        builder, impl = getattr(module, spec.builder, None), getattr(module, spec.impl, None)
        if builder is None or impl is None:
            raise LookupError(f"{name}: {spec.builder}/{spec.impl} not found")
        if not callable(getattr(builder, "build", None)):
            raise LookupError(f"{name}: {spec.builder}.build not found")
        if not _forward_ok(impl):
            raise LookupError(
                f"{name}: {spec.impl}.forward does not take attn_metadata as ({', '.join(FORWARD_ARGS)}, ...)"
            )
        return builder, impl
    members = [v for v in vars(module).values() if inspect.isclass(v) and v.__module__ == name]
    builders = [c for c in members if c.__name__.endswith("MetadataBuilder") and callable(getattr(c, "build", None))]
    impls = [c for c in members if c.__name__.endswith("Impl") and _forward_ok(c)]
    if len(builders) != 1 or len(impls) != 1:
        raise LookupError(
            f"{name}: expected one *MetadataBuilder with build and one *Impl with forward({', '.join(FORWARD_ARGS)}, "
            f"...); found builders {[c.__name__ for c in builders]}, impls {[c.__name__ for c in impls]}"
        )
    return builders[0], impls[0]


# --- the tensors a metadata object shows ---------------------------------------------------------------------------


def _is_tensor(v: Any) -> bool:
    return hasattr(v, "detach") and hasattr(v, "numel") and hasattr(v, "shape")


def _children(obj: Any) -> list[tuple[str, Any]]:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    if inspect.ismodule(obj) or inspect.isclass(obj) or inspect.isroutine(obj):
        return []
    try:
        return list(vars(obj).items())
    except TypeError:  # no __dict__ (ints, strings, enums with slots...)
        return []


def tensor_fields(md: Any, spec: BackendFields) -> tuple[dict[str, Any], dict[str, str]]:
    """Every tensor reachable from a metadata object (dataclass fields, attributes of the objects they hold such as
    FlashInfer's wrappers, list and tuple items), by dotted path: (the tensors to check, the tensors not checked
    with why). A path its backend's table excludes is not checked, nor a tensor over MAX_ELEMENTS."""
    checked: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    seen: set[int] = set()

    def walk(obj: Any, prefix: str, depth: int) -> None:
        if id(obj) in seen or depth > MAX_DEPTH:
            return
        seen.add(id(obj))
        for name, v in _children(obj):
            path = f"{prefix}{name}"
            if v is None:
                continue
            why = spec.excluded_reason(path)
            if _is_tensor(v):
                if why is not None:
                    skipped[path] = why
                elif v.numel() > MAX_ELEMENTS:
                    skipped[path] = f"{v.numel()} elements: too large to copy at every forward"
                else:
                    checked[path] = v
            elif why is None and isinstance(v, (list, tuple)):
                for i, item in enumerate(v):
                    if _is_tensor(item) and item.numel() <= MAX_ELEMENTS:
                        checked[f"{path}[{i}]"] = item
                    elif not _is_tensor(item) and not isinstance(item, (int, float, str, bool)):
                        walk(item, f"{path}[{i}].", depth + 1)
            elif why is None and not isinstance(v, (int, float, str, bool, bytes, dict)):
                walk(v, f"{path}.", depth + 1)

    walk(md, "", 1)
    return checked, skipped


def unlisted(paths: list[str] | set[str], spec: BackendFields) -> list[str]:
    """The tensor paths a metadata object showed that its backend's table does not list (checked by the rule)."""
    return sorted(p for p in paths if not spec.listed(p)) if spec.prefix else []


# --- the table in words (docs/backend-fields.md) -------------------------------------------------------------------


def markdown() -> str:
    """The per-backend field table: every checked and excluded field with its reason, and what an in-graph draft
    refresh rewrites."""
    rows = ["| backend | field | checked | why |", "|---|---|---|---|"]
    for b in BACKENDS.values():
        for path, what in b.checked.items():
            refresh = f" In-graph draft refresh: {b.refreshed_in_graph[path]}." if path in b.refreshed_in_graph else ""
            rows.append(f"| {b.name} | `{path}` | yes | {what}.{refresh} |")
        for path, why in b.excluded.items():
            rows.append(f"| {b.name} | `{path}` | no | {why} |")
    return "\n".join(rows)
