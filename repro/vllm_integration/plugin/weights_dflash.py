"""The `agree` construction for a DFlash draft (gate method `dflash`: vLLM's DFlashQwen3ForCausalLM, a block drafted
in one non-causal pass): two layers whose head 0 reads two positions back, the first with an MLP lookup table that
writes SIGMA of what it read where a mask token sits (docs/dflash.md has the derivation). The target and the shared
pieces (codes, SIGMA, head 0's key, the noise) are repro.vllm_integration.plugin.weights'; installed by its
`install`."""

from __future__ import annotations

import math
from typing import Any

from repro.vllm_integration.plugin.weights import (
    _LAYER,
    CODE_DIMS,
    CONST_DIM,
    LOGIT_GAIN,
    PAIRS,
    READ_AT,
    SCORE_NORM2,
    SEED,
    _config,
    _noise,
    codes,
    device_of,
    embed_rms,
    head0_query_key,
    sigma,
)

DFLASH_MODELS = ("DFlashQwen3ForCausalLM",)  # the DFlash drafts dflash_weights constructs (gate method `dflash`)
DFLASH_BACK = 2  # each DFlash draft layer's head 0 reads the position this many back: the target's own rule
# the DFlash draft's residual dimensions beyond the embedding's and READ: head 0 of its first layer writes the code it
# read to A1; that layer's MLP (a lookup table over the vocabulary) writes the code of SIGMA of it to PRED
DFLASH_A1 = READ_AT + CODE_DIMS
DFLASH_PRED = DFLASH_A1 + CODE_DIMS
LOOKUP_MATCH = 86.0  # a code's dot product with its own is CODE_DIMS (128), with any other of 4096 below ~50
LOOKUP_GATE = 16.0  # the matching lookup unit's gate (SiLU ~ linear there); the others' at most about -16 (SiLU ~ 0)


def query_back(head_dim: int, theta: float, back: int) -> Any:
    """Head 0's query that, against head0_query_key's key, peaks at the position `back` before the query's (neox
    pairs): the key rotated back by `back` positions (head0_query_key's query is back=1)."""
    import torch  # as above

    half = head_dim // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    amp = math.sqrt(SCORE_NORM2 / PAIRS)
    q = torch.zeros(head_dim, dtype=torch.float64)
    q[:PAIRS] = amp * torch.cos(back * inv[:PAIRS])
    q[half : half + PAIRS] = -amp * torch.sin(back * inv[:PAIRS])
    return q


def _dflash_mlp(w: Any, up: bool, inter: int, code: Any, perm: list[int], hidden: int) -> None:
    """The first DFlash layer's MLP units (Qwen2MLP: down(silu(gate) * up), no biases; its input is the residual
    embedding + A1, RMS-normed: nominal rms r): units [0, vocab) a lookup (unit v: gate LOOKUP_GATE where A1 is the
    code of v, about -16 or below elsewhere; up the constant; down code(SIGMA[v]) to PRED), units [vocab, vocab +
    CODE_DIMS) the identity negated (gate the constant, up minus one code dimension, down back to it: the position's
    own token code leaves the residual, so the second layer's values read only PRED there)."""
    import torch  # as above

    vocab = code.shape[0]
    r = math.sqrt((2 * CODE_DIMS + 1) / hidden)
    g = LOOKUP_GATE * r / (CODE_DIMS - LOOKUP_MATCH)  # per unit of <code v, A1> - LOOKUP_MATCH at rms r
    a1, pred = slice(DFLASH_A1, DFLASH_A1 + CODE_DIMS), slice(DFLASH_PRED, DFLASH_PRED + CODE_DIMS)
    cancel = slice(vocab, vocab + CODE_DIMS)
    eye = torch.eye(CODE_DIMS, dtype=torch.float64, device=w.device)
    if up:
        w[:vocab, a1] = g * code
        w[:vocab, CONST_DIM] = -g * LOOKUP_MATCH
        w[inter : inter + vocab, CONST_DIM] = 1.0
        w[cancel, CONST_DIM] = LOOKUP_GATE * r
        w[inter + vocab : inter + vocab + CODE_DIMS, :CODE_DIMS] = -eye
    else:  # silu(gate) * up is LOOKUP_GATE / r times the wanted value at the nominal rms
        w[pred, :vocab] = code[torch.tensor(perm, device=code.device)].T * r / LOOKUP_GATE
        w[:CODE_DIMS, cancel] = eye * r / LOOKUP_GATE


def dflash_weights(model: Any, seed: int = SEED, noise: bool = True) -> dict:
    """The `agree` construction for a two-layer DFlash draft (vLLM's DFlashQwen3ForCausalLM, method `dflash`).

    DFlash drafts a block in one non-causal pass: the query at q0 holds the target's bonus token x(q0), q0+1.. hold
    the mask token, and the query at position P is the draft for x(P). Each layer's keys are the context (the target's
    aux hidden states at accepted positions <= q0-1, through fc, hidden_norm and that layer's K/V rows) and the
    block's own positions. The target decides x(P) = SIGMA[x(P-2)], so both layers read "the token two back":
      fc       the first aux state's code and constant (x(p)'s embedding part) through: a context row is x(p)'s
               embedding, as a block token's is
      layer 1  head 0 reads the code two back into A1; the MLP (_dflash_mlp) looks it up and writes code(SIGMA[v])
               to PRED, and removes the position's own token code: PRED = the code of x(P) for P <= q0 + 2
      layer 2  head 0 reads the code and PRED dimensions two back (the context's code; a block position's PRED) into
               READ; the target's LM head (shared, as the embedding: dummy loading never marks the draft's own)
               applies SIGMA
    so block positions 1..4 agree (3 and 4 read the masks' PRED); 5 on would need a third layer. q_norm/k_norm
    (Qwen3's per-head norms: |q| = |k| = sqrt(head_dim)) get sqrt(SCORE_NORM2 / head_dim), the target's score scale.
    `noise` fills the other heads, the MLP units past the lookup and the second MLP as agreement_weights does, never
    into A1, PRED or READ."""
    import torch  # as above

    c = _config(model)
    hidden, d, nq, nkv, vocab = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["vocab"]
    if d < CODE_DIMS or hidden < DFLASH_PRED + CODE_DIMS:
        raise ValueError(f"the DFlash construction needs head_dim >= {CODE_DIMS}, hidden >= {DFLASH_PRED + CODE_DIMS}")
    params = dict(model.named_parameters())
    layers = sorted({int(m.group(1)) for n in params if (m := _LAYER.search(n))})
    dev = device_of(params)
    code, perm = codes(vocab, seed).to(dev), sigma(vocab, seed)
    k0 = head0_query_key(d, c["theta"])[1].to(dev)
    q0 = query_back(d, c["theta"], DFLASH_BACK).to(dev)
    eye = torch.eye(CODE_DIMS, dtype=torch.float64, device=dev)
    rms1, rms2 = embed_rms(hidden), math.sqrt((2 * CODE_DIMS + 1) / hidden)  # each layer's input, nominal
    read, pred = slice(READ_AT, READ_AT + CODE_DIMS), slice(DFLASH_PRED, DFLASH_PRED + CODE_DIMS)
    kept = [slice(DFLASH_A1, DFLASH_A1 + CODE_DIMS), pred, read]  # no noise writes here
    unknown, n = [], 0
    with torch.no_grad(), torch.device(dev):
        for name, p in params.items():
            if not torch.is_floating_point(p):
                continue
            shape = tuple(p.shape)
            w = torch.zeros(shape, dtype=torch.float64)
            step = layers.index(int(m.group(1))) if (m := _LAYER.search(name)) else None  # 0: layer 1, 1: layer 2
            if name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                w.fill_(math.sqrt(SCORE_NORM2 / d))
            elif name.endswith("mask_embedding"):
                pass  # used only with a mask_embedding.pt, which dummy loading never reads
            elif p.dim() < 2:
                w.fill_(1.0)  # RMSNorm weights (hidden_norm, the layers' norms, the final norm)
            elif name.endswith("embed_tokens.weight"):  # the target's (shared): code and constant
                w[:, :CODE_DIMS] = code[: shape[0]]
                w[:, CONST_DIM] = 1.0
            elif name.endswith("lm_head.weight"):  # the target's (shared): row SIGMA[v] reads the code of v in READ
                rows = min(shape[0], vocab)
                inv = torch.empty(rows, dtype=torch.long)
                inv[torch.tensor(perm[:rows])] = torch.arange(rows)
                w[:rows, read] = LOGIT_GAIN * code[inv]
            elif name.endswith("fc.weight"):
                w[: CONST_DIM + 1, : CONST_DIM + 1] = torch.eye(CONST_DIM + 1, dtype=torch.float64)
            elif step is None or step > 1:
                unknown.append(name)
            elif name.endswith("qkv_proj.weight"):
                if noise:
                    w = _noise(name, shape, seed, dev)
                k_at, v_at = nq * d, (nq + nkv) * d
                w[:d], w[k_at : k_at + d], w[v_at : v_at + d] = 0.0, 0.0, 0.0
                w[:d, CONST_DIM], w[k_at : k_at + d, CONST_DIM] = q0, k0
                w[v_at : v_at + CODE_DIMS, :CODE_DIMS] = eye * (rms1 if step == 0 else rms2)
                if step == 1:
                    w[v_at : v_at + CODE_DIMS, pred] = eye * rms2
            elif name.endswith("o_proj.weight"):
                if noise:
                    w = _noise(name, shape, seed, dev)
                    w[:, :d] = 0.0
                    for k in kept:
                        w[k] = 0.0
                w[kept[0] if step == 0 else read, :CODE_DIMS] = eye
            elif name.endswith(("gate_up_proj.weight", "down_proj.weight")):
                up = name.endswith("gate_up_proj.weight")
                inter = shape[0] // 2 if up else shape[1]
                units = vocab + CODE_DIMS if step == 0 else 0  # the first layer's constructed units
                if inter < units:
                    raise ValueError(f"the DFlash construction needs intermediate_size >= {units}: {inter}")
                if noise:
                    w = _noise(name, shape, seed, dev)
                    if up:
                        w[:units], w[inter : inter + units] = 0.0, 0.0
                    else:
                        w[:, :units] = 0.0
                        for k in kept:
                            w[k] = 0.0
                if units:
                    _dflash_mlp(w, up, inter, code, perm, hidden)
            else:
                unknown.append(name)
            p.copy_(w.to(p.dtype))
            n += 1
    return {"parameters": n, "unknown": unknown, "layer": layers[0] if layers else None, "construction": "dflash"}


BY_MODEL = {name: dflash_weights for name in DFLASH_MODELS}  # weights.install's by_model: the plugin passes it
