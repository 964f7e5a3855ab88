"""The gate model's weights, written over vLLM's dummy weights inside the engine (a request's weights, REPRO_WEIGHTS in
the gate's environment, installed by repro.vllm_integration.plugin after DummyModelLoader.load_weights).

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
  of that half stay as noise draws them, head 0's are zero). EAGLE3 differs twice more (`_eagle3`): its fc reads the
  target's auxiliary hidden states, of which it takes the embedding dimensions of the state after the target's first
  layer (vLLM appends the embedding tensor itself as layer 0's state, and the target's fused residual adds then
  update it in place: by the time the draft reads it, it holds the target's decision); and the hidden state it
  carries from one draft step to the next is its own residual stream, decided token included, so one head of the
  second KV group attends to its own position and subtracts the READ dimensions the carried state brings (without
  it the draft's READ holds two codes, and it proposes the token it was given as often as the next one). A MiMo MTP
  layer's input_proj passes the normed
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


def _noise(name: str, shape: tuple, seed: int, device: Any = "cpu") -> Any:
    """A random fill for a parameter the construction leaves zero: N(0, 1/fan_in), outputs into the residual stream
    (o_proj, down_proj) scaled by NOISE_GAIN. Drawn on `device` (the parameter's: in vLLM's process the GPU, where
    the draws cost milliseconds instead of seconds on a CPU thread; on the CPU, the same values as ever). On the GPU
    the values depend on the SM count the process sees (torch caps its random grid by it): a case is compared only
    with its reference in the same SM configuration, and the decided tokens keep margins of about 20 nats."""
    import torch  # as above

    g = torch.Generator(device=device).manual_seed(seed ^ zlib.crc32(name.encode()))
    gain = NOISE_GAIN if name.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
    return torch.randn(shape, generator=g, dtype=torch.float64, device=device) * shape[1] ** -0.5 * gain


def device_of(params: dict) -> Any:
    """Where a model's floating parameters are (the first one's device; the CPU for a model without one): the
    constructions build their tensors there (inside `with torch.device(...)`), so that a GPU model's weights are
    made on the GPU."""
    import torch  # as above

    return next((p.device for p in params.values() if torch.is_floating_point(p)), torch.device("cpu"))


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
    dev = device_of(params)
    code = codes(vocab, seed).to(dev)
    perm = sigma(vocab, seed)
    rms = embed_rms(hidden)
    q0, k0 = (t.to(dev) for t in head0_query_key(d, c["theta"]))
    unknown, n = [], 0
    eagle3 = "Eagle3" in type(model).__name__  # vLLM's Eagle3*ForCausalLM classes (registry.py, 0.27-0.34)
    if not eagle3 and any(name.endswith("hidden_norm.weight") for name in params):  # a DFlash layer has one too
        raise ValueError(
            f"{type(model).__name__} has a hidden_norm but is no Eagle3 draft: no `agree` construction here"
        )
    with torch.no_grad(), torch.device(dev):
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
            elif name.endswith("fc.weight") and eagle3:  # EAGLE3: [aux 0, aux 1, aux 2] -> aux 1's embedding part
                w[: CONST_DIM + 1, hidden : hidden + CONST_DIM + 1] = (
                    torch.eye(CONST_DIM + 1, dtype=torch.float64) / rms
                )
            elif name.endswith("fc.weight"):  # EAGLE: [embedding, target hidden] -> hidden; the embedding, normed
                w[:hidden, :hidden] = torch.eye(hidden, dtype=torch.float64) / rms
            elif name.endswith("input_proj.weight"):  # MTP (MiMo): [target hidden, normed embedding] -> the embedding
                w[:, hidden : 2 * hidden] = torch.eye(hidden, dtype=torch.float64)
            elif layer is not None and layer != first:  # later layers: they run, and add (next to) nothing
                if not name.endswith(LINEAR):
                    unknown.append(name)
                elif noise:
                    w = _noise(name, tuple(p.shape), seed, dev)
            elif name.endswith("qkv_proj.weight"):  # rows: q heads, k heads, v heads
                k_at, v_at = nq * d, (nq + nkv) * d  # head 0's key and value rows
                if noise:
                    w = _noise(name, tuple(p.shape), seed, dev)
                    w[:d], w[k_at : k_at + d], w[v_at : v_at + d] = 0.0, 0.0, 0.0  # head 0's q, k, v are exact
                w[:d, CONST_DIM] = q0 * rms  # the normed constant is 1/rms
                w[k_at : k_at + d, CONST_DIM] = k0 * rms
                w[v_at : v_at + CODE_DIMS, :CODE_DIMS] = torch.eye(CODE_DIMS, dtype=torch.float64) * rms
            elif name.endswith("o_proj.weight"):
                if noise:
                    w = _noise(name, tuple(p.shape), seed, dev)
                    w[:, :d] = 0.0  # head 0's output lands in READ only
                    w[READ_AT : READ_AT + CODE_DIMS] = 0.0  # and nothing else does
                w[READ_AT : READ_AT + CODE_DIMS, :CODE_DIMS] = torch.eye(CODE_DIMS, dtype=torch.float64)
            elif name.endswith(("gate_up_proj.weight", "down_proj.weight")):
                if noise:  # the MLP adds (next to) nothing, and never to READ
                    w = _noise(name, tuple(p.shape), seed, dev)
                    if name.endswith("down_proj.weight"):
                        w[READ_AT : READ_AT + CODE_DIMS] = 0.0
            else:
                unknown.append(name)
            if eagle3 and layer == first and name.endswith(("qkv_proj.weight", "o_proj.weight")):
                _eagle3(name, w, c)
            p.copy_(w.to(p.dtype))
            n += 1
    return {"parameters": n, "unknown": unknown, "layer": first}


def carried_rms(hidden: int) -> float:
    """The root mean square of the residual stream an EAGLE3 draft step carries to the next: its fc's output (the
    embedding over its rms: rms 1) plus one code in READ (CODE_DIMS entries of about 1)."""
    return math.sqrt(1 + CODE_DIMS / hidden)


def _eagle3(name: str, w: Any, c: dict) -> None:
    """EAGLE3's draft layer, written over the `agree` construction (see the module): the first head of the second KV
    group attends to its own position (query = key: the score peaks at offset 0) and its value is minus the READ
    dimensions of the carried hidden state (the second half of the layer's input, normed: times carried_rms to undo
    the norm); its output lands in READ, so the carried code cancels and head 0's code is the one READ holds."""
    import torch  # as above

    hidden, d, nq, nkv = c["hidden"], c["head_dim"], c["heads"], c["kv_heads"]
    if nkv < 2:
        raise ValueError(f"the EAGLE3 agreement weights need two KV heads: {c}")
    head = nq // nkv  # the first query head that reads KV head 1
    k0 = head0_query_key(d, c["theta"])[1].to(w.device)
    rms = embed_rms(hidden)
    if name.endswith("qkv_proj.weight"):
        k_at, v_at = nq * d + d, (nq + nkv) * d + d  # KV head 1's key and value rows
        for rows in (slice(head * d, (head + 1) * d), slice(k_at, k_at + d), slice(v_at, v_at + d)):
            w[rows] = 0.0
        w[head * d : (head + 1) * d, CONST_DIM] = k0 * rms
        w[k_at : k_at + d, CONST_DIM] = k0 * rms
        carried = hidden + READ_AT  # the carried state's READ, in the normed second half of the input
        w[v_at : v_at + CODE_DIMS, carried : carried + CODE_DIMS] = -torch.eye(
            CODE_DIMS, dtype=torch.float64, device=w.device
        ) * (carried_rms(hidden))
    else:  # o_proj: that head's output goes to READ and nowhere else
        w[:, head * d : (head + 1) * d] = 0.0
        w[READ_AT : READ_AT + CODE_DIMS, head * d : head * d + CODE_DIMS] = torch.eye(
            CODE_DIMS, dtype=torch.float64, device=w.device
        )


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


def install(loader_cls: Any, kind: str, emit: Any, by_model: dict | None = None) -> None:
    """After vLLM's dummy loader fills a model, write `kind`'s weights and emit what was written. by_model: model class
    name -> the `agree` construction for that class where it is not agreement_weights (the DFlash draft's:
    weights_dflash.BY_MODEL, passed by the plugin)."""
    orig = loader_cls.load_weights
    by_model = by_model or {}

    def load_weights(self, model: Any, model_config: Any) -> None:
        orig(self, model, model_config)
        if kind in (AGREE, AGREE_EXACT):
            rec = by_model.get(type(model).__name__, agreement_weights)(model, noise=kind == AGREE)
            emit({"weights": kind, "model": type(model).__name__, **rec})
        else:
            emit({"weights": MARGIN, "model": type(model).__name__, "parameters": margin_weights(model)})

    loader_cls.load_weights = load_weights
