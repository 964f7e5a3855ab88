"""A small Llama-style target and an EAGLE-style draft with seeded random weights (no hub).

Attention goes through a ForwardContext: a paged KV cache written through a slot mapping, and either an FA3 backend
(with the metadata views the context holds) or the plain-PyTorch reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from repro.attention.reference import paged_attention_reference
from repro.case.descriptors import AttnConfig


@dataclass(frozen=True)
class ModelConfig:
    vocab: int = 1024
    hidden: int = 512
    layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 128
    intermediate: int = 1024
    rope_theta: float = 10000.0
    seed: int = 0

    def attn_config(self, **kw: Any) -> AttnConfig:
        return AttnConfig(num_heads_q=self.q_heads, num_heads_kv=self.kv_heads, head_dim=self.head_dim, **kw)


@dataclass
class ForwardContext:
    """What one forward's attention layers need: metadata views, KV caches, and how to attend."""

    metadata: Any  # repro.attention.builder.AttnMetadata
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: k_cache, v_cache [pages, page, kv_heads, d]
    slot_mapping: torch.Tensor  # [T] int64
    backend: Any = None  # FA3 backend, or None for the reference
    sm_margin: int = 0
    seen: list = field(default_factory=list)  # metadata build ids attention saw (for the CPU tier)

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        md = self.metadata
        k_cache, v_cache = self.kv[layer]
        self.seen.append(md.build_id)
        if self.backend is None:
            out = paged_attention_reference(
                q,
                k_cache,
                v_cache,
                md.query_start_loc.tolist(),
                md.seq_lens.tolist(),
                md.block_table,
                md.config.causal,
                md.config.window_left,
            )
            return out.to(q.dtype)
        out = torch.empty_like(q)
        md.launch(self.backend, q, k_cache, v_cache, out, self.sm_margin)
        return out


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()).to(x.dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    ang = positions.float()[:, None] * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x.float()[..., : d // 2], x.float()[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.qkv = nn.Linear(cfg.hidden, (cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)
        self.o = nn.Linear(cfg.q_heads * cfg.head_dim, cfg.hidden, bias=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        c = self.cfg
        q, k, v = self.qkv(h).split([c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
        q = rotary(q.view(-1, c.q_heads, c.head_dim), positions, c.rope_theta)
        k = rotary(k.view(-1, c.kv_heads, c.head_dim), positions, c.rope_theta)
        v = v.reshape(-1, c.kv_heads, c.head_dim)
        k_cache, v_cache = ctx.kv[self.layer]
        k_cache.view(-1, c.kv_heads, c.head_dim).index_copy_(0, ctx.slot_mapping, k)
        v_cache.view(-1, c.kv_heads, c.head_dim).index_copy_(0, ctx.slot_mapping, v)
        return self.o(ctx.attend(self.layer, q).reshape(-1, c.q_heads * c.head_dim))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(cfg.hidden), RMSNorm(cfg.hidden)
        self.attn = Attention(cfg, layer)
        self.gate_up = nn.Linear(cfg.hidden, 2 * cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, cfg.hidden, bias=False)

    def forward(self, h: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), positions, ctx)
        g, u = self.gate_up(self.mlp_norm(h)).chunk(2, -1)
        return h + self.down(nn.functional.silu(g) * u)


def _init(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(module.named_parameters()):
        if "norm" in name:
            continue
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1]) ** 0.5)


class TargetModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden)
        self.lm_head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        _init(self, cfg.seed)
        with torch.no_grad():
            self.embed.weight.mul_(4.0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        """Returns (hidden states before the final norm, which EAGLE consumes; logits)."""
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h, positions, ctx)
        return h, self.lm_head(self.norm(h)).float()


class EagleDraft(nn.Module):
    """EAGLE: fc over [embed(next token), target hidden], one decoder layer, the target's embedding and LM head."""

    def __init__(self, cfg: ModelConfig, target: TargetModel) -> None:
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden, cfg.hidden, bias=False)
        self.layer = DecoderLayer(cfg, 0)
        self.norm = RMSNorm(cfg.hidden)
        _init(self, cfg.seed + 1)
        self._target = [target]  # shared weights, not a submodule (no double registration)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext):
        t = self._target[0]
        h = self.fc(torch.cat([t.embed(input_ids), hidden], -1))
        h = self.layer(h, positions, ctx)
        return h, t.lm_head(self.norm(h)).float()
