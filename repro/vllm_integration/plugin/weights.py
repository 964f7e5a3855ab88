"""The gate model's weights, written over vLLM's dummy weights inside the engine (REPRO_WEIGHTS, installed by
repro.vllm_integration.plugin after DummyModelLoader.load_weights).

`agree` (the gate's default): a target whose every generated token is decided by a wide margin, and an EAGLE draft
built to agree with it, so that the draft's output reaches the result (acceptance) and numerics cannot flip a token.

- The target is a previous-token model: the token after position m is SIGMA[x(m-1)], a fixed permutation of the
  vocabulary. Its first decoder layer's attention does it. Every token embedding is a code (CODE_DIMS random +-1
  entries) plus a constant 1 in one dimension (CONST_DIM); query and key of head 0 are made from that constant, rotated
  so that with vLLM's (neox) RoPE the score peaks at the previous position (PAIRS frequency pairs, SCORE_NORM2); head 0's value is the code, its output goes to the READ dimensions, and the LM head reads the code
  there: logit(SIGMA[v]) = LOGIT_GAIN * <code v, READ>. Everything else is zero: the other heads, the MLPs (down_proj
  0) and every later layer, so the residual stream is the embedding plus that one head.
- The EAGLE draft (vLLM's EagleLlama: fc over [token embedding, target hidden state], one decoder layer without its
  input norm, no final norm, the target's LM head) gets the same layer: fc passes the embedding through (scaled to what
  the target's RMSNorm makes of it) and drops the target's hidden state. The draft's position i holds token x(i+1)
  (EAGLE's shift), so attending to position i-1 it reads x(i) and proposes SIGMA[x(i)]: the target's token at i+2.
  A draft whose attention reads the wrong positions or requests (stale metadata) proposes tokens the target rejects.
- The other methods (repro.vllm_integration.gate.methods) get the same layer by the same names: an EAGLE3 draft's
  first layer normalizes the embedding itself and concatenates the target's hidden state after it (the qkv columns
  of that half stay as noise draws them, head 0's are zero); a MiMo MTP layer's input_proj passes the normed
  embedding through ([target hidden, embedding] -> embedding) and its Qwen2 q/k/v biases are zero; a standalone
  draft Llama (draft_model) is a one-layer copy of the target's construction and proposes what the target decides.
- A DFlash draft (dflash_weights, method dflash: a block drafted in one non-causal pass) gets two layers whose head 0
  reads two positions back, the first with an MLP lookup table that writes SIGMA of what it read where a mask token
  sits, so every block position up to 4 proposes what the target decides (docs/dflash.md has the derivation).

`agree` fills what the construction leaves zero (the other heads, the MLPs, the later layers) with random values as
`margin` draws them, the outputs into the residual stream scaled by NOISE_GAIN: every kernel computes on realistic
activations (what a stale read finds in memory is not all zeros), and the decided tokens keep their margins.
`agree-exact` leaves them zero. A parameter the construction does not know is zeroed and named in the record
(`unknown`), never guessed.

`margin` (the previous default): every parameter redrawn from a per-name seed (norms 1, embeddings N(0,1), linear
layers N(0, 1/fan_in)): margins of 0.02-0.7 nats and a draft the target never accepts."""

from __future__ import annotations

import math
import re
import zlib
from typing import Any

AGREE, AGREE_EXACT, MARGIN, DUMMY = "agree", "agree-exact", "margin", "dummy"
WEIGHTS = (AGREE, AGREE_EXACT, MARGIN)
NOISE_GAIN = 0.05  # `agree`: the parameters the construction leaves zero get random values, their outputs this small
SEED = 0
CODE_DIMS = 128  # the code of a token: +-1 in these leading residual dimensions (a value of head 0 carries it whole)
CONST_DIM = CODE_DIMS  # a constant 1 in every embedding: what head 0's query and key are made of
READ_AT = 2 * CODE_DIMS  # head 0's output lands in [READ_AT, READ_AT + head_dim); the LM head reads it there
PAIRS = 8  # RoPE frequency pairs the previous-token score uses (the fastest: the sharpest peak)
SCORE_NORM2 = 300.0  # |q| * |k| of head 0: a score gap of about 5.6 nats to any other position, and no two scores
# more than ~53 nats apart (a softmax weight exp(-gap) never underflows to an exact 0: see the module)
LOGIT_GAIN = 0.12  # about 20 nats between the target's top two logits, 10 for the draft (no final norm)
SPECIAL = 3  # token ids below this (pad, bos, eos) map to themselves: SIGMA never produces them
_LAYER = re.compile(r"layers\.(\d+)\.")
LINEAR = ("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")  # a decoder layer's matrices


def sigma(vocab: int, seed: int = SEED) -> list[int]:
    """The permutation the target applies: SIGMA[v] is the token after a position whose previous token was v."""
    import torch  # torch inside vLLM's process only: the gate's parent imports this module

    g = torch.Generator().manual_seed(seed + 1)
    rest = (torch.randperm(vocab - SPECIAL, generator=g) + SPECIAL).tolist()
    return list(range(SPECIAL)) + rest


def codes(vocab: int, seed: int = SEED) -> Any:
    """[vocab, CODE_DIMS] of +-1: each token's code (float32)."""
    import torch  # as above

    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (vocab, CODE_DIMS), generator=g).float() * 2 - 1


def _config(model: Any) -> dict:
    cfg = getattr(model, "config", None)
    rope = getattr(cfg, "rope_parameters", None) or {}
    theta = getattr(cfg, "rope_theta", None) or (rope.get("rope_theta") if isinstance(rope, dict) else None) or 1e4
    heads = int(cfg.num_attention_heads)
    hidden = int(cfg.hidden_size)
    return {
        "hidden": hidden,
        "heads": heads,
        "kv_heads": int(getattr(cfg, "num_key_value_heads", heads)),
        "head_dim": int(getattr(cfg, "head_dim", None) or hidden // heads),
        "vocab": int(cfg.vocab_size),
        "theta": float(theta),
    }


def embed_rms(hidden: int) -> float:
    """The root mean square of every embedding row (CODE_DIMS entries of +-1 and the constant 1)."""
    return math.sqrt((CODE_DIMS + 1) / hidden)


def head0_query_key(head_dim: int, theta: float) -> tuple[Any, Any]:
    """Head 0's query and key before RoPE (neox pairs i, i + head_dim/2): the key is equal in the PAIRS fastest
    pairs, the query the key rotated back by one position, so q(m) . k(n) = |q||k| mean_i cos((n - m + 1) theta_i)
    peaks at n = m - 1."""
    import torch  # as above

    half = head_dim // 2
    inv = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / head_dim)
    amp = math.sqrt(SCORE_NORM2 / PAIRS)
    k, q = torch.zeros(head_dim, dtype=torch.float64), torch.zeros(head_dim, dtype=torch.float64)
    k[:PAIRS] = amp
    q[:PAIRS] = amp * torch.cos(inv[:PAIRS])
    q[half : half + PAIRS] = -amp * torch.sin(inv[:PAIRS])
    return q, k


def _noise(name: str, shape: tuple, seed: int) -> Any:
    """A random fill for a parameter the construction leaves zero: N(0, 1/fan_in), outputs into the residual stream
    (o_proj, down_proj) scaled by NOISE_GAIN."""
    import torch  # as above

    g = torch.Generator().manual_seed(seed ^ zlib.crc32(name.encode()))
    gain = NOISE_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
    return torch.randn(shape, generator=g, dtype=torch.float64) * shape[1] ** -0.5 * gain


def agreement_weights(model: Any, seed: int = SEED, noise: bool = True) -> dict:
    """Write the `agree` construction (see the module) into a vLLM Llama or EagleLlama model's parameters. Returns
    {"parameters": n written, "unknown": [names zeroed that it does not know], "layer": first decoder layer index}."""
    import torch  # as above

    c = _config(model)
    hidden, d, nq, nkv, vocab = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"], c["vocab"]
    if d < CODE_DIMS or hidden < READ_AT + d:
        raise ValueError(f"agreement weights need head_dim >= {CODE_DIMS} and hidden >= {READ_AT + d}: {c}")
    params = dict(model.named_parameters())
    layers = sorted({int(m.group(1)) for n in params if (m := _LAYER.search(n))})
    first = layers[0] if layers else None
    code = codes(vocab, seed)
    perm = sigma(vocab, seed)
    rms = embed_rms(hidden)
    q0, k0 = head0_query_key(d, c["theta"])
    unknown, n = [], 0
    with torch.no_grad():
        for name, p in params.items():
            if not torch.is_floating_point(p):
                continue
            w = torch.zeros(tuple(p.shape), dtype=torch.float64)
            layer = int(m.group(1)) if (m := _LAYER.search(name)) else None
            if p.dim() < 2:
                if not name.endswith(".bias"):  # Qwen2's (MiMo's) q/k/v biases stay zero
                    w.fill_(1.0)  # RMSNorm weights
            elif name.endswith("embed_tokens.weight"):
                w[:, :CODE_DIMS] = code[: p.shape[0]]
                w[:, CONST_DIM] = 1.0
            elif name.endswith("lm_head.weight"):
                rows = min(p.shape[0], vocab)
                inv = torch.empty(rows, dtype=torch.long)
                inv[torch.tensor(perm[:rows])] = torch.arange(rows)  # row SIGMA[v] reads the code of v
                w[:rows, READ_AT : READ_AT + CODE_DIMS] = LOGIT_GAIN * code[inv]
            elif name.endswith("fc.weight"):  # EAGLE: [embedding, target hidden] -> hidden; the embedding, normed
                w[:hidden, :hidden] = torch.eye(hidden, dtype=torch.float64) / rms
            elif name.endswith("input_proj.weight"):  # MTP (MiMo): [target hidden, normed embedding] -> the embedding
                w[:, hidden : 2 * hidden] = torch.eye(hidden, dtype=torch.float64)
            elif layer is not None and layer != first:  # later layers: they run, and add (next to) nothing
                if not name.endswith(LINEAR):
                    unknown.append(name)
                elif noise:
                    w = _noise(name, tuple(p.shape), seed)
            elif name.endswith("qkv_proj.weight"):  # rows: q heads, k heads, v heads
                k_at, v_at = nq * d, (nq + nkv) * d  # head 0's key and value rows
                if noise:
                    w = _noise(name, tuple(p.shape), seed)
                    w[:d], w[k_at : k_at + d], w[v_at : v_at + d] = 0.0, 0.0, 0.0  # head 0's q, k, v are exact
                w[:d, CONST_DIM] = q0 * rms  # the normed constant is 1/rms
                w[k_at : k_at + d, CONST_DIM] = k0 * rms
                w[v_at : v_at + CODE_DIMS, :CODE_DIMS] = torch.eye(CODE_DIMS, dtype=torch.float64) * rms
            elif name.endswith("o_proj.weight"):
                if noise:
                    w = _noise(name, tuple(p.shape), seed)
                    w[:, :d] = 0.0  # head 0's output lands in READ only
                    w[READ_AT : READ_AT + CODE_DIMS] = 0.0  # and nothing else does
                w[READ_AT : READ_AT + CODE_DIMS, :CODE_DIMS] = torch.eye(CODE_DIMS, dtype=torch.float64)
            elif name.endswith(("gate_up_proj.weight", "down_proj.weight")):
                if noise:  # the MLP adds (next to) nothing, and never to READ
                    w = _noise(name, tuple(p.shape), seed)
                    if name.endswith("down_proj.weight"):
                        w[READ_AT : READ_AT + CODE_DIMS] = 0.0
            else:
                unknown.append(name)
            p.copy_(w.to(p.dtype))
            n += 1
    return {"parameters": n, "unknown": unknown, "layer": first}


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
    eye = torch.eye(CODE_DIMS, dtype=torch.float64)
    if up:
        w[:vocab, a1] = g * code
        w[:vocab, CONST_DIM] = -g * LOOKUP_MATCH
        w[inter : inter + vocab, CONST_DIM] = 1.0
        w[cancel, CONST_DIM] = LOOKUP_GATE * r
        w[inter + vocab : inter + vocab + CODE_DIMS, :CODE_DIMS] = -eye
    else:  # silu(gate) * up is LOOKUP_GATE / r times the wanted value at the nominal rms
        w[pred, :vocab] = code[torch.tensor(perm)].T * r / LOOKUP_GATE
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
    code, perm = codes(vocab, seed), sigma(vocab, seed)
    _, k0 = head0_query_key(d, c["theta"])
    q0 = query_back(d, c["theta"], DFLASH_BACK)
    eye = torch.eye(CODE_DIMS, dtype=torch.float64)
    rms1, rms2 = embed_rms(hidden), math.sqrt((2 * CODE_DIMS + 1) / hidden)  # each layer's input, nominal
    read, pred = slice(READ_AT, READ_AT + CODE_DIMS), slice(DFLASH_PRED, DFLASH_PRED + CODE_DIMS)
    kept = [slice(DFLASH_A1, DFLASH_A1 + CODE_DIMS), pred, read]  # no noise writes here
    unknown, n = [], 0
    with torch.no_grad():
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
                    w = _noise(name, shape, seed)
                k_at, v_at = nq * d, (nq + nkv) * d
                w[:d], w[k_at : k_at + d], w[v_at : v_at + d] = 0.0, 0.0, 0.0
                w[:d, CONST_DIM], w[k_at : k_at + d, CONST_DIM] = q0, k0
                w[v_at : v_at + CODE_DIMS, :CODE_DIMS] = eye * (rms1 if step == 0 else rms2)
                if step == 1:
                    w[v_at : v_at + CODE_DIMS, pred] = eye * rms2
            elif name.endswith("o_proj.weight"):
                if noise:
                    w = _noise(name, shape, seed)
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
                    w = _noise(name, shape, seed)
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


def margin_weights(model: Any, seed: int = SEED) -> int:
    """Redraw every floating parameter from a seed of its own name; returns how many were drawn."""
    import torch  # as above

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


def install(loader_cls: Any, kind: str, emit: Any) -> None:
    """After vLLM's dummy loader fills a model, write `kind`'s weights and emit what was written."""
    orig = loader_cls.load_weights

    def load_weights(self, model: Any, model_config: Any) -> None:
        orig(self, model, model_config)
        if kind in (AGREE, AGREE_EXACT):
            build = dflash_weights if type(model).__name__ in DFLASH_MODELS else agreement_weights
            rec = build(model, noise=kind == AGREE)
            emit({"weights": kind, "model": type(model).__name__, **rec})
        else:
            emit({"weights": MARGIN, "model": type(model).__name__, "parameters": margin_weights(model)})

    loader_cls.load_weights = load_weights
