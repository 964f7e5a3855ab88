#!/usr/bin/env python3
"""Make a source mutant of an installed vLLM 0.34.0: a prefix whose speculator capture builds FULL-graph attention
metadata for the wrong descriptor (batch shape), one mutant per speculative capture path.

    python scripts/mutate_vllm.py SRC_PREFIX DEST_PREFIX --mutant NAME
    python scripts/mutate_vllm.py --list

SRC_PREFIX is a folder holding an installed `vllm/` package (and its vllm-X.dist-info), as the gate's
`--vllm LABEL=PREFIX` takes. DEST_PREFIX (absent or empty) becomes a copy of it in which every entry is a symlink
into SRC_PREFIX except the folders on the path to the patched file (made here, their other entries symlinked; the
patched file's own `__pycache__` is left out, so Python never writes the patched module's bytecode into SRC) and the
patched file itself.
The dist-info stays a symlink, so `importlib.metadata.version('vllm')` answers as for SRC. SRC is never written.

A mutant is an exact text replacement that must match exactly once in the file it names; otherwise (another vLLM
version, or a file already patched) the script changes nothing, leaves nothing at DEST_PREFIX and exits 2. It writes
DEST_PREFIX/MUTANT.json: the mutant's name, what it does wrong, the gate methods it affects, the file, the anchor and
its replacement, and the unified diff.

The refresh's mutant (`refresh-previous-step`, vLLM 0.34.0's flash_attn.py): the draft-decode refresh of FA3's
scheduler metadata computes for the previous draft step; only the auditor's refresh judging (plugin/refresh.py) sees
it in audit, and only where a sequence crosses a KV block (FA3's metadata depends on seq_lens through block counts:
a one-token shift changes nothing elsewhere; the self control's stale-refresh form shifts far ahead instead). The dynamic-K mutant (`dynamic-k-one-build-per-shape`, autoregressive/cudagraph_utils.py): a
K-specialized capture builds each batch shape's metadata once, in its first K's pass, for every K's capture of that
shape; only the descriptor check keyed by K (plugin/dynamic_k.py) sees it, with a dynamic-K method
(`--methods eagle_dynamic_k`). The replay path's mutant (`standalone-partial-copy`, standalone_ar/speculator.py):
StandaloneARSpeculator's runtime expanded prefill replays its FULL graph with the last request's seq_lens entry left
at the previous batch's value after the batch's build; only the replay check (plugin/replay.py) sees it in audit,
with method draft_model. The wrong-descriptor mutants follow.

The bug class each wrong-descriptor mutant re-creates (vLLM 0.21-0.25, fixed by PR #48261 for the AR prefill manager): a draft FULL
CUDA-graph capture runs with attention metadata built for ANOTHER descriptor than the one being captured. Here the
object and the persistent buffers behind its views (query_start_loc, seq_lens, FA3 scheduler_metadata, slot
mappings) are built together, consistently, by the build's own builder, but for the neighbouring entry of the same
FULL capture list (the next smaller; the smallest takes the next larger), so the metadata agrees with itself and
only a check against the captured descriptor sees it. The graph keyed by descriptor D bakes a kernel launch sized
for D' (grid over D''s request count, FA3 scheduler metadata of D'): at replay it reads the buffers the runtime
refreshed for D with D''s shape, which skips or over-reads requests. A list of one FULL entry has no neighbour: the
mutant is then inert (the script cannot know the capture list; the gate's configuration has several entries).

Which gate methods each changes (`--methods`): target-dependent-wrong-descriptor eagle, eagle3, mtp (TargetDependentAR
prefill only: its capture passes no slot-mapping buffer and its query length is above 1); standalone-wrong-descriptor
draft_model (StandaloneAR prefill only: the one capture that passes its own slot-mapping buffer); dflash-wrong-descriptor
the DFlash family (the gate's dflash method). Draft decode graphs are untouched by all three. The anchors, not the
version, decide: 0.33.0 has no autoregressive/cudagraph_utils.py (refused), but its dflash/cudagraph.py is 0.34.0's.

On the machine that runs the gate, with the 0.34.0 build in PREFIX and its torch in TORCH (the mutant is a known-bad
build the gate must catch, so it goes in as a control, beside the clean release):

    python scripts/mutate_vllm.py PREFIX PREFIX-td --mutant target-dependent-wrong-descriptor
    python -m repro gate --vllm 0.34.0=PREFIX --torch 0.34.0=TORCH \
        --control 0.34.0-td=PREFIX-td --torch 0.34.0-td=TORCH --methods eagle,eagle3,mtp
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

EXIT_REFUSED = 2
VERSION = "0.34.0"
SPEC = "vllm/v1/worker/gpu/spec_decode"

# The neighbour of `desc` in its manager's FULL capture list (sorted by num_tokens, largest first): the next smaller
# entry, the smallest takes the next larger.
_NEIGHBOUR = """\
                full = self._capture_descs[CUDAGraphMode.FULL]
                i = full.index(desc)
                md = full[i + 1 if i + 1 < len(full) else max(i - 1, 0)]
"""
# What every mutant changes in its anchor (a call that prepares a capture's inputs for `desc`): the same call for md
_FOR_NEIGHBOUR = (
    ("                num_reqs,\n", "                md.num_reqs or min(md.num_tokens, self.max_num_reqs),\n"),
    ("                num_tokens,\n", "                md.num_tokens,\n"),
    ("desc.max_query_len or desc.uniform_token_count", "md.max_query_len or md.uniform_token_count"),
)

_AR_ANCHOR = """\
            attn_metadata, slot_mappings = prepare_inputs_to_capture(
                num_reqs,
                num_tokens,
                model_state,
                input_buffers,
                block_tables,
                attn_groups,
                kv_cache_config,
                full_cudagraph=desc.cg_mode == CUDAGraphMode.FULL,
                max_query_len=desc.max_query_len or desc.uniform_token_count,
                slot_mappings_buffer=slot_mappings_buffer,
            )
"""
_DFLASH_ANCHOR = """\
            attn_state = _prepare_dflash_inputs_to_capture(
                num_reqs,
                num_tokens,
                input_buffers,
"""


def wrong_descriptor(anchor: str, condition: str | None) -> str:
    """The replacement of a mutant's anchor: the capture's inputs prepared for md, desc's neighbour in the FULL
    capture list in a FULL capture where `condition` holds too (None: every FULL capture), desc elsewhere."""
    call = anchor
    for old, new in _FOR_NEIGHBOUR:
        call = call.replace(old, new)
    guard = "desc.cg_mode == CUDAGraphMode.FULL" + (f" and {condition}" if condition else "")
    return f"            md = desc\n            if {guard}:\n" + _NEIGHBOUR + call


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to the prefix
    anchor: str
    replacement: str
    wrong: str  # what the capture does wrong
    methods: tuple[str, ...]  # the gate's speculative methods whose capture it changes
    manager: str  # the capture manager it changes


# name, file, anchor, the condition beside FULL that selects the capture path, what it does wrong, methods, manager
_TABLE = (
    (
        "target-dependent-wrong-descriptor",
        f"{SPEC}/autoregressive/cudagraph_utils.py",
        _AR_ANCHOR,
        # Only TargetDependentARSpeculator's prefill manager takes this branch: its capture passes no slot-mapping
        # buffer (StandaloneAR passes its expanded one), and the decode managers have query length 1.
        "slot_mappings_buffer is None and self.decode_query_len > 1",
        "TargetDependentARSpeculator's draft-prefill FULL capture (EAGLE, EAGLE3, MTP, Gemma4) builds its "
        "attention metadata and the target's shared persistent buffers (query_start_loc, seq_lens, FA3 "
        "scheduler_metadata, through the target's input buffers and attention groups) for the neighbouring "
        "entry of its FULL capture list, not for the descriptor captured; the graph and the forward keep the "
        "captured descriptor's token and request counts. Draft decode graphs and StandaloneAR are untouched.",
        ("eagle", "eagle3", "mtp"),
        "SpeculatorCudaGraphManager (TargetDependentAR prefill)",
    ),
    (
        "standalone-wrong-descriptor",
        f"{SPEC}/autoregressive/cudagraph_utils.py",
        _AR_ANCHOR,
        # Only StandaloneARSpeculator's prefill capture passes a slot-mapping buffer (its expanded_slot_mappings).
        "slot_mappings_buffer is not None",
        "StandaloneARSpeculator's (method draft_model, FULL graphs new in 0.34.0) expanded-prefill FULL "
        "capture builds its attention metadata, the persistent buffers and its own slot-mapping buffer "
        "(expanded_slot_mappings, filled for the neighbour's token count) for the neighbouring entry of its "
        "FULL capture list, not for the descriptor captured. Draft decode graphs and TargetDependentAR are "
        "untouched.",
        ("draft_model",),
        "SpeculatorCudaGraphManager (StandaloneAR prefill)",
    ),
    (
        "dflash-wrong-descriptor",
        f"{SPEC}/dflash/cudagraph.py",
        _DFLASH_ANCHOR,
        None,
        "DFlashCudaGraphManager's parallel-drafting query FULL capture (its own "
        "_prepare_dflash_inputs_to_capture, the builder beside the one PR #48261 fixed) builds the dummy "
        "batch, block tables, slot mappings and attention metadata for the neighbouring entry of its FULL "
        "capture list; prepare_forward and the forward keep the captured descriptor's counts.",
        ("dflash", "dflash2", "dspark", "xpress", "lilicorr"),
        "DFlashCudaGraphManager (query forward)",
    ),
)
MUTANTS = {
    name: Mutant(name, file, anchor, wrong_descriptor(anchor, condition), wrong, methods, manager)
    for name, file, anchor, condition, wrong, methods, manager in _TABLE
}
# The dynamic-K mutant: a K-specialized capture (SpeculatorCudaGraphManager.capture with specialize_spec_tokens) builds
# each batch shape's metadata once per pass kind, in its first K's pass, and hands that build to every other K's
# capture of the same shape: the graph of one K captured on the metadata of another K's pass.
_ONE_BUILD_PER_SHAPE = (
    '            _kept = self.__dict__.setdefault("_one_build_per_shape", {})\n'
    "            _shape = (desc.cg_mode, num_tokens, num_reqs, warmup)\n"
    "            if _shape not in _kept or not isinstance(desc, SpeculatorBatchDescriptor):\n"
    "                _kept[_shape] = prepare_inputs_to_capture(\n"
)
MUTANTS["dynamic-k-one-build-per-shape"] = Mutant(
    "dynamic-k-one-build-per-shape",
    f"{SPEC}/autoregressive/cudagraph_utils.py",
    _AR_ANCHOR,
    _ONE_BUILD_PER_SHAPE
    + "".join("    " + line + "\n" for line in _AR_ANCHOR.splitlines()[1:])
    + "            attn_metadata, slot_mappings = _kept[_shape]\n",
    "SpeculatorCudaGraphManager's K-specialized capture (dynamic speculative decoding, "
    "num_speculative_tokens_per_batch_size) builds each batch shape's attention metadata once per pass kind, in "
    "the first K's pass, and hands it to every other K's capture of that shape. Unspecialized captures are "
    "untouched (the mutant is inert without a K schedule).",
    ("eagle_dynamic_k", "eagle3_dynamic_k", "mtp_dynamic_k", "draft_model_dynamic_k"),
    "SpeculatorCudaGraphManager (K-specialized draft decode)",
)
# The refresh's mutant: FA3's draft-decode refresh (FlashAttentionMetadataBuilder.update_draft_decode_metadata, run
# eagerly in a draft capture's warmup pass and recorded into every fused draft decode graph) computes the scheduler
# metadata for the previous draft step (every seq_lens entry one less) instead of the step its views show: the faithful
# one-step defect, visible only at a step where a sequence crosses a KV block (FA3's metadata counts blocks).
_REFRESH_ANCHOR = """\
            max_query_len=metadata.max_query_len,
            seqlens=metadata.seq_lens,
"""
MUTANTS["refresh-previous-step"] = Mutant(
    "refresh-previous-step",
    "vllm/v1/attention/backends/flash_attn.py",
    _REFRESH_ANCHOR,
    _REFRESH_ANCHOR.replace("seqlens=metadata.seq_lens,", "seqlens=(metadata.seq_lens - 1).clamp(min=0),"),
    "FlashAttentionMetadataBuilder.update_draft_decode_metadata (the in-graph and eager draft-decode refresh of "
    "FA3's scheduler_metadata) computes for the previous draft step: seq_lens one less per request than the step "
    "its views show. Every FULL draft decode graph records it (and DFlash's query graph); builds are untouched.",
    ("eagle", "eagle3", "mtp", "draft_model", "dflash"),
    "every speculator's draft-decode refresh (FLASH_ATTN)",
)


# The replay path's mutant: StandaloneARSpeculator's runtime expanded prefill (propose, never a capture) copies every
# request's seq_lens into the persistent buffer and builds the batch's metadata, then, in the FULL branch only and
# after the build, the last request's entry goes back to what it held in the previous FULL prefill (the previous
# batch's last request): a partial copy, the graph replayed on one entry of another batch's metadata.
_PREFILL_REPLAY_ANCHOR = """\
            if prefill_batch_desc.cg_mode == CUDAGraphMode.FULL:
                assert self.prefill_cudagraph_manager is not None
                self.prefill_cudagraph_manager.run_fullgraph(prefill_batch_desc)
"""
_LAST_ENTRY_PREVIOUS_BATCH = """\
            if prefill_batch_desc.cg_mode == CUDAGraphMode.FULL:
                assert self.prefill_cudagraph_manager is not None
                if num_reqs:
                    _last = self.input_buffers.seq_lens[num_reqs - 1 : num_reqs]
                    _previous = getattr(self, "_partial_copy_previous", None)
                    self._partial_copy_previous = _last.clone()
                    if _previous is not None:
                        _last.copy_(_previous)
                self.prefill_cudagraph_manager.run_fullgraph(prefill_batch_desc)
"""
MUTANTS["standalone-partial-copy"] = Mutant(
    "standalone-partial-copy",
    f"{SPEC}/standalone_ar/speculator.py",
    _PREFILL_REPLAY_ANCHOR,
    _LAST_ENTRY_PREVIOUS_BATCH,
    "StandaloneARSpeculator.propose (method draft_model), at runtime only: the expanded-prefill inputs are prepared "
    "and the batch's attention metadata built, then, where the expanded prefill replays a FULL graph, the last "
    "request's entry of the persistent seq_lens buffer (input_buffers.seq_lens) holds the previous FULL prefill's "
    "last-request value, so the FULL prefill graph replays one request's seqlen_k from another batch (FA3's "
    "scheduler_metadata planned for this batch's). Captures, the descriptor check, eager and PIECEWISE prefills and "
    "the draft decode graphs (their inputs rewritten by _prepare_decode_inputs) are untouched: in audit only the "
    "replay check sees it (stale-replay at seq_lens of the StandaloneAR prefill descriptor, at a sampled replay "
    "whose previous batch's last entry differs). Plain mode likely sees at most a lower draft acceptance (the last "
    "request's draft attends over too few or too many KV entries; greedy verification keeps the output right), "
    "and may see nothing; a seqlen_k past the planned splits may fault in FA3.",
    ("draft_model",),
    "SpeculatorCudaGraphManager (StandaloneAR prefill, at replay)",
)


class Refused(Exception):
    """The mutant cannot be made from this SRC_PREFIX / into this DEST_PREFIX; nothing was written."""


def installed_version(src: Path) -> str:
    """The version the prefix's vllm dist-info declares, or 'unknown'."""
    for info in sorted(src.glob("vllm-*.dist-info")):
        meta = info / "METADATA"
        if meta.is_file():
            for line in meta.read_text(errors="replace").splitlines():
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip()
    return "unknown"


def patched_text(src: Path, mutant: Mutant) -> tuple[str, str]:
    """The file's text before and after the mutant; Refused unless its anchor occurs exactly once."""
    target = src / mutant.file
    version = installed_version(src)
    if not target.is_file():
        raise Refused(
            f"{mutant.name}: {mutant.file} is not in {src} (vLLM {version}); the mutant is written for vLLM {VERSION}"
        )
    before = target.read_text()
    count = before.count(mutant.anchor)
    if count != 1:
        where = "not found" if count == 0 else f"found {count} times"
        raise Refused(
            f"{mutant.name}: its anchor text is {where} in {mutant.file} (vLLM {version} in {src}); the mutant is "
            f"written for vLLM {VERSION}'s sources and changes nothing elsewhere"
        )
    return before, before.replace(mutant.anchor, mutant.replacement)


def mirror(src: Path, dest: Path, rel: Path, text: str) -> None:
    """Make dest mirror src by symlinks, except the folders on rel's path (made) and the file rel (written as text)."""
    parts = rel.parts
    src_dir, dest_dir = src, dest
    dest_dir.mkdir(parents=True, exist_ok=True)
    for depth, part in enumerate(parts):
        for entry in sorted(os.listdir(src_dir)):
            # The patched folder's bytecode cache is not carried: Python would otherwise write the patched
            # module's .pyc through the link into SRC.
            if entry == part or entry == "__pycache__" and depth == len(parts) - 1:
                continue
            os.symlink(src_dir / entry, dest_dir / entry)
        src_dir, dest_dir = src_dir / part, dest_dir / part
        if depth < len(parts) - 1:
            dest_dir.mkdir()
    dest_dir.write_text(text)
    os.chmod(dest_dir, (src_dir.stat().st_mode & 0o777) | 0o200)


def make(src: Path, dest: Path, name: str) -> dict:
    """Make the mutant `name` of src at dest; the marker's record. Refused leaves dest as it was."""
    if name not in MUTANTS:
        raise Refused(f"no mutant named {name!r}; --list names them: {', '.join(MUTANTS)}")
    mutant = MUTANTS[name]
    src = src.resolve()
    if not (src / "vllm" / "__init__.py").is_file():
        raise Refused(f"{src} holds no installed vllm/ package")
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise Refused(f"{dest} exists and is not an empty folder")
    dest = dest.absolute()
    if dest == src or src in dest.parents:
        raise Refused(f"{dest} lies inside {src}, which is never written")
    before, after = patched_text(src, mutant)
    created = not dest.exists()
    try:
        mirror(src, dest, Path(mutant.file), after)
        record = {
            "mutant": mutant.name,
            "vllm_version": installed_version(src),
            "written_for": VERSION,
            "source_prefix": str(src),
            **{k: v for k, v in asdict(mutant).items() if k != "name"},
            "methods": list(mutant.methods),
            "diff": "".join(
                difflib.unified_diff(
                    before.splitlines(keepends=True),
                    after.splitlines(keepends=True),
                    f"a/{mutant.file}",
                    f"b/{mutant.file}",
                )
            ),
        }
        (dest / "MUTANT.json").write_text(json.dumps(record, indent=2) + "\n")
    except BaseException:
        clear(dest, keep_folder=not created)
        raise
    return record


def clear(dest: Path, keep_folder: bool) -> None:
    """Remove what mirror made at dest (links are removed, never followed)."""
    import shutil  # only on failure

    if dest.exists():
        for entry in dest.iterdir():
            if entry.is_symlink() or entry.is_file():
                entry.unlink()
            else:
                shutil.rmtree(entry)
        if not keep_folder:
            dest.rmdir()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", nargs="?", type=Path, help="prefix holding the installed vllm/ package")
    parser.add_argument("dest", nargs="?", type=Path, help="prefix to make (absent or empty)")
    parser.add_argument("--mutant", help="the mutant to apply (--list names them)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = parser.parse_args(argv)
    if args.list:
        for m in MUTANTS.values():
            print(f"{m.name}\n  file: {m.file}\n  methods: {', '.join(m.methods)}\n  manager: {m.manager}")
            print(f"  wrong: {m.wrong}")
        return 0
    if args.src is None or args.dest is None or args.mutant is None:
        parser.error("SRC_PREFIX, DEST_PREFIX and --mutant are required (or --list)")
    try:
        record = make(args.src, args.dest, args.mutant)
    except Refused as refused:
        print(f"mutate_vllm: refused, nothing written: {refused}", file=sys.stderr)
        return EXIT_REFUSED
    print(f"{record['mutant']}: {args.dest} (vLLM {record['vllm_version']}, patched {record['file']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
