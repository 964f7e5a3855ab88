"""Persistent-buffer attention-metadata builder with vLLM's semantics (FlashAttentionMetadataBuilder + make_dummy).

Every build writes the SAME persistent buffers and returns views of them, so a view kept from an earlier build
shows whatever the latest build wrote: the mechanism behind the stale-metadata bug."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from repro.backends.base import Fa3Backend
from repro.backends.layout import MetadataLayout, effective_causal, layout_from_size, vllm_buffer_size
from repro.case.descriptors import AttnConfig, BatchDescriptor
from repro.case.poison import Poison
from repro.errors import ConfigError

_build_ids = itertools.count(1)


@dataclass
class AttnMetadata:
    """What a forward gets: host parameters of the batch it was built for plus views of persistent buffers."""

    descriptor: BatchDescriptor
    build_id: int
    query_start_loc: Any  # view [:num_reqs + 1]
    seq_lens: Any  # view [:num_reqs]
    block_table: Any  # view [:num_reqs]
    scheduler_metadata: Any  # view [:n], n = layout.size
    layout: MetadataLayout
    max_query_len: int
    max_seq_len: int
    num_splits: int
    config: AttnConfig
    request: dict  # the get_scheduler_metadata call that built it
    poisoned_entries: int = 0

    def launch(self, backend: Any, q: Any, k_cache: Any, v_cache: Any, out: Any, sm_margin: int) -> None:
        """vLLM's FA3 forward: host parameters of the batch this was built for, device data from the views."""
        cfg = self.config
        backend.forward(
            q,
            k_cache,
            v_cache,
            out=out,
            cu_seqlens_q=self.query_start_loc,
            seqused_k=self.seq_lens,
            max_seqlen_q=self.max_query_len,
            max_seqlen_k=self.max_seq_len,
            block_table=self.block_table,
            causal=cfg.causal,
            window=cfg.window,
            scheduler_metadata=self.scheduler_metadata,
            num_splits=self.num_splits,
            sm_margin=sm_margin,
        )

    def snapshot(self) -> dict[str, list[int]]:
        """Contents the views show right now (copied to the host)."""
        return {
            "query_start_loc": self.query_start_loc.tolist(),
            "seq_lens": self.seq_lens.tolist(),
            "scheduler_metadata": self.scheduler_metadata.tolist(),
        }


class MetadataBuilder:
    """One attention group's builder: persistent buffers sized for the engine's max batch."""

    def __init__(
        self,
        backend: Fa3Backend,
        cfg: AttnConfig,
        device: Any = "cpu",
        sm_margin: int = 0,
        poison: Poison | None = None,
    ) -> None:
        import torch  # torch only when buffers are made: scenarios and expectations import this module without it

        self.backend, self.cfg, self.device, self.sm_margin, self.poison = backend, cfg, device, sm_margin, poison
        mb = cfg.max_batch
        i32 = dict(dtype=torch.int32, device=device)
        self.query_start_loc = torch.zeros(mb + 1, **i32)
        self.seq_lens = torch.zeros(mb, **i32)
        # Every request owns distinct pages, so a correct forward has one right answer per request.
        nb = cfg.max_blocks_per_seq
        self.block_table = torch.arange(mb * nb, **i32).view(mb, nb)
        self.scheduler_metadata = torch.zeros(vllm_buffer_size(mb), **i32)
        self.builds: list[tuple[int, BatchDescriptor]] = []

    @property
    def num_pages(self) -> int:
        return self.block_table.numel()

    def write_batch(self, desc: BatchDescriptor, seq_lens: list[int]) -> None:
        """Write a batch's query_start_loc (padded with num_tokens) and seq_lens (zero past the batch) INTO the
        persistent buffers, as the runtime and make_dummy both do."""
        import torch  # as above

        if desc.num_reqs > self.cfg.max_batch:
            raise ConfigError(
                f"descriptor {desc.label} needs {desc.num_reqs} requests, over max batch {self.cfg.max_batch}"
            )
        if len(seq_lens) != desc.num_reqs:
            raise ValueError(f"{len(seq_lens)} seq_lens for {desc.num_reqs} requests")
        if max(seq_lens) > self.cfg.max_model_len:
            raise ConfigError(f"sequence of {max(seq_lens)} tokens over max_model_len {self.cfg.max_model_len}")
        lens = torch.tensor(desc.query_lens(), dtype=torch.int32)
        sl = torch.zeros(self.cfg.max_batch, dtype=torch.int32)
        sl[: desc.num_reqs] = torch.tensor(seq_lens, dtype=torch.int32)
        self.seq_lens.copy_(sl.to(self.device))
        qsl = torch.full((self.cfg.max_batch + 1,), desc.num_tokens, dtype=torch.int32)
        qsl[0] = 0
        qsl[1 : desc.num_reqs + 1] = torch.cumsum(lens, 0)
        self.query_start_loc.copy_(qsl.to(self.device))

    def make_dummy(self, desc: BatchDescriptor) -> None:
        """InputBatch.make_dummy: seq_lens = query lens, written INTO the persistent input buffers."""
        self.write_batch(desc, desc.query_lens())

    def layout_for(self, desc: BatchDescriptor, size: int) -> MetadataLayout:
        is_causal, is_local = effective_causal(
            self.cfg.causal, self.cfg.window_left, desc.max_query_len, self.cfg.max_model_len, self.cfg.head_dim, True
        )
        return layout_from_size(self.backend.flavor, desc.num_reqs, size, is_causal, is_local)

    def build(self, desc: BatchDescriptor) -> AttnMetadata:
        """prepare_inputs_to_capture + FlashAttentionMetadataBuilder.build for a FULL uniform-decode descriptor."""
        self.make_dummy(desc)
        return self._build(desc)

    def build_runtime(self, desc: BatchDescriptor, seq_lens: list[int]) -> AttnMetadata:
        """The runtime build that refreshes the persistent buffers before a replay (real context lengths)."""
        self.write_batch(desc, seq_lens)
        return self._build(desc)

    def _build(self, desc: BatchDescriptor) -> AttnMetadata:
        import torch  # as above

        b = desc.num_reqs
        qsl, seq_lens = self.query_start_loc[: b + 1], self.seq_lens[:b]
        request = dict(
            batch_size=b,
            max_seqlen_q=desc.max_query_len,
            max_seqlen_k=self.cfg.max_model_len,
            num_heads_q=self.cfg.num_heads_q,
            num_heads_kv=self.cfg.num_heads_kv,
            head_dim=self.cfg.head_dim,
            cache_seqlens=seq_lens,
            cu_seqlens_q=qsl,
            page_size=self.cfg.page_size,
            causal=self.cfg.causal,
            window=self.cfg.window,
            num_splits=self.cfg.num_splits,
            sm_margin=self.sm_margin,
            dtype=torch.bfloat16,
        )
        md = self.backend.scheduler_metadata(**request)
        # keep what the call saw: the views it got are rewritten by the next build
        request.update(cache_seqlens=seq_lens.clone(), cu_seqlens_q=qsl.clone())
        n = md.numel()
        if n > self.scheduler_metadata.numel():
            raise ConfigError(
                f"metadata for {desc.label} has {n} ints, over vLLM's buffer of {self.scheduler_metadata.numel()}"
            )
        layout = self.layout_for(desc, n)
        poisoned = self.poison.apply(md, layout) if self.poison else 0
        self.scheduler_metadata[:n] = md
        self.scheduler_metadata[n:] = 0
        build_id = next(_build_ids)
        self.builds.append((build_id, desc))
        return AttnMetadata(
            descriptor=desc,
            build_id=build_id,
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=self.block_table[:b],
            scheduler_metadata=self.scheduler_metadata[:n],
            layout=layout,
            max_query_len=desc.max_query_len,
            max_seq_len=self.cfg.max_model_len,
            num_splits=self.cfg.num_splits,
            config=self.cfg,
            request=request,
            poisoned_entries=poisoned,
        )

    @property
    def last_build(self) -> tuple[int, BatchDescriptor] | None:
        return self.builds[-1] if self.builds else None
