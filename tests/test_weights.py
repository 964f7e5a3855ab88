"""The gate model's `agree` weights (repro.vllm_integration.plugin.weights) in a CPU re-implementation of the forward pass
vLLM runs on them (Llama: RMSNorm, neox RoPE, GQA causal attention scaled by head_dim^-0.5, SiLU MLP; EagleLlama: fc
over [embedding, target hidden], one layer without its input norm, no final norm, the target's LM head), with the
gate's model configuration (repro.vllm_integration.gate.worker TARGET/DRAFT) and bf16 parameters: the target decodes
SIGMA[previous token] by a wide margin, the draft proposes exactly the target's next tokens, and a draft whose
attention reads another request's keys proposes tokens the target rejects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from repro.vllm_integration.gate.worker import DRAFT, PROMPTS, TARGET  # noqa: E402
from repro.vllm_integration.plugin import weights  # noqa: E402


class FakeModel(torch.nn.Module):
    """Parameters named and shaped as vLLM's Llama / EagleLlama name them (TP 1: merged qkv and gate_up)."""

    def __init__(self, cfg: dict, layers: list[int], draft: bool):
        super().__init__()
        self.config = SimpleNamespace(**cfg)
        h, d, nq, nkv, v, i = (
            cfg[k]
            for k in (
                "hidden_size",
                "head_dim",
                "num_attention_heads",
                "num_key_value_heads",
                "vocab_size",
                "intermediate_size",
            )
        )
        p = {"model.embed_tokens.weight": (v, h)}
        for n in layers:
            pre = f"model.layers.{n}."
            if not draft or n != layers[0]:
                p[pre + "input_layernorm.weight"] = (h,)
            p[pre + "self_attn.qkv_proj.weight"] = ((nq + 2 * nkv) * d, h)
            p[pre + "self_attn.o_proj.weight"] = (h, nq * d)
            p[pre + "post_attention_layernorm.weight"] = (h,)
            p[pre + "mlp.gate_up_proj.weight"] = (2 * i, h)
            p[pre + "mlp.down_proj.weight"] = (h, i)
        if draft:
            p["model.fc.weight"] = (h, 2 * h)
        else:
            p["model.norm.weight"] = (h,)
        p["lm_head.weight"] = (v, h)
        self.names = list(p)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16), requires_grad=False) for s in p.values()]
        )
        self.layers, self.draft, self.cfg = layers, draft, cfg

    def named_parameters(self, *a, **k):
        return iter(zip(self.names, self.ps))

    def w(self, name: str):
        return dict(self.named_parameters())[name].float()


def rms(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x, pos, theta):  # neox: pairs (i, i + d/2)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(d // 2, dtype=torch.float32) * 2 / d)
    ang = pos[:, None].float() * inv[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def layer(m: FakeModel, n: int, x, residual, pos, keys_from=None):
    """One decoder layer; keys_from=(x', pos') takes keys and values from other hidden states (a stale read)."""
    c = m.cfg
    d, nq, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    pre = f"model.layers.{n}."
    qkv = x @ m.w(pre + "self_attn.qkv_proj.weight").T
    q = qkv[:, : nq * d].view(-1, nq, d)
    kx, kpos = keys_from if keys_from is not None else (x, pos)
    kv = kx @ m.w(pre + "self_attn.qkv_proj.weight").T
    k = kv[:, nq * d : (nq + nkv) * d].view(-1, nkv, d)
    v = kv[:, (nq + nkv) * d :].view(-1, nkv, d)
    q, k = rope(q, pos, c["rope_theta"]), rope(k, kpos, c["rope_theta"])
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    s = s.masked_fill(kpos[None, None, :] > pos[None, :, None], float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(len(pos), nq * d)
    residual = residual + o @ m.w(pre + "self_attn.o_proj.weight").T
    x = rms(residual) * m.w(pre + "post_attention_layernorm.weight")
    gu = x @ m.w(pre + "mlp.gate_up_proj.weight").T
    g, u = gu.chunk(2, -1)
    return residual, torch.nn.functional.silu(g) * u @ m.w(pre + "mlp.down_proj.weight").T


def target_logits(m: FakeModel, toks: list[int]):
    pos = torch.arange(len(toks))
    residual = m.w("model.embed_tokens.weight")[torch.tensor(toks)]
    mlp = torch.zeros_like(residual)
    for n in m.layers:
        residual = residual + mlp
        x = rms(residual) * m.w(f"model.layers.{n}.input_layernorm.weight")
        residual, mlp = layer(m, n, x, residual, pos)
    final = rms(residual + mlp) * m.w("model.norm.weight")
    return final @ m.w("lm_head.weight").T, final


def draft_logits(m: FakeModel, lm_head, toks, hidden, stale_from=None):
    """EAGLE: position i holds toks[i] (the target's token at i+1) and the target's hidden state at i."""
    pos = torch.arange(len(toks))
    e = m.w("model.embed_tokens.weight")
    x = torch.cat([e[torch.tensor(toks)], hidden], -1) @ m.w("model.fc.weight").T
    keys = None
    if stale_from is not None:
        sx = torch.cat([e[torch.tensor(stale_from)], torch.zeros(len(stale_from), x.shape[1])], -1)
        keys = (sx @ m.w("model.fc.weight").T, torch.arange(len(stale_from)))
    residual, mlp = layer(m, m.layers[0], x, x, pos, keys_from=keys)
    return (residual + mlp) @ lm_head.T


# under xdist, every test reading it runs on one worker (conftest's SHARED_FIXTURE): it runs once
@pytest.fixture(scope="module")
def models():
    t = FakeModel({**TARGET}, list(range(TARGET["num_hidden_layers"])), draft=False)
    dr = FakeModel({**DRAFT}, [TARGET["num_hidden_layers"]], draft=True)
    for m in (t, dr):
        rec = weights.agreement_weights(m)
        assert rec["unknown"] == [] and rec["parameters"] == len(m.names)
    return t, dr


def margins(logits):
    top = logits.topk(2, -1).values
    return top[:, 0] - top[:, 1]


_DECODED: dict = {}  # (model, prompt) -> (the longest greedy sequence decoded, each step's margin): tests share it


def decode(t: FakeModel, prompt: list[int], n: int) -> tuple[list[int], float]:
    """The target's greedy tokens after prompt (n of them) and the smallest top-2 log-probability margin among them;
    each step decoded once per model and prompt however many tests ask (a full forward per token)."""
    seq, steps = _DECODED.get((t, tuple(prompt)), (list(prompt), []))
    for _ in range(n - len(steps)):
        lg, _ = target_logits(t, seq)
        lp = lg[-1].log_softmax(-1)
        steps = [*steps, margins(lp[None])[0].item()]
        seq = [*seq, int(lp.argmax())]
    _DECODED[(t, tuple(prompt))] = (seq, steps)
    return seq[: len(prompt) + n], min(steps[:n], default=float("inf"))


def test_target_decodes_sigma_of_the_previous_token_by_a_wide_margin(models):
    t, _ = models
    s = weights.sigma(TARGET["vocab_size"])
    for prompt in PROMPTS:
        seq, smallest = decode(t, prompt, 8)
        assert seq[len(prompt) :] == [s[seq[j - 2]] for j in range(len(prompt), len(seq))]
        assert smallest > 15.0, smallest  # nats between the top two log-probabilities
        assert len(set(seq[len(prompt) :])) == len(seq) - len(prompt)  # no repeats: not a degenerate reference


def test_draft_proposes_the_targets_next_tokens_and_a_stale_read_does_not(models):
    t, dr = models
    lm_head = t.w("lm_head.weight")
    seqs = [decode(t, p, 8)[0] for p in PROMPTS[:2]]
    for k, (seq, prompt) in enumerate(zip(seqs, PROMPTS)):
        _, hidden = target_logits(t, seq)
        shifted = seq[1:]  # EAGLE: draft position i holds the target's token at i + 1
        lg = draft_logits(dr, lm_head, shifted, hidden[:-1])
        # position i proposes the token at i + 2: compared where that token was decoded (not the prompt's)
        lo = len(prompt) - 2
        want = torch.tensor(seq[lo + 2 :])
        got = lg[lo:].argmax(-1)[: len(want)]
        assert torch.equal(got, want)
        assert margins(lg[lo:]).min().item() > 5.0
        # keys and values from the other request (what stale query_start_loc / seq_lens read): rejected proposals
        other = seqs[1 - k]
        stale = draft_logits(dr, lm_head, shifted, hidden[:-1], stale_from=other[1:])
        n = min(len(want), len(other) - 1 - lo)
        assert (stale[lo : lo + n].argmax(-1) != want[:n]).float().mean().item() > 0.9


def test_head0_scores_peak_at_the_previous_position_within_the_model_length():
    q, k = weights.head0_query_key(TARGET["head_dim"], TARGET["rope_theta"])
    d = TARGET["head_dim"]
    pos = torch.arange(TARGET["max_position_embeddings"])
    qm = rope(q.float()[None, None, :], torch.tensor([pos[-1]]), TARGET["rope_theta"])[0, 0]
    ks = rope(k.float()[None, :].expand(len(pos), 1, d).clone(), pos, TARGET["rope_theta"])[:, 0]
    s = ks @ qm * d**-0.5
    assert int(s.argmax()) == len(pos) - 2
    others = torch.cat([s[:-2], s[-1:]])
    assert (s[-2] - others.max()).item() > 5.0
    assert (s.max() - s.min()).item() < 60.0  # no softmax weight underflows to an exact 0


def test_a_parameter_it_does_not_know_is_zeroed_and_named(models):
    m = FakeModel({**TARGET}, [0], draft=False)
    m.names[-2] = "model.layers.0.self_attn.q_norm_extra.weight2d"
    m.ps[-2] = torch.nn.Parameter(torch.randn(4, 4).to(torch.bfloat16), requires_grad=False)
    rec = weights.agreement_weights(m)
    assert rec["unknown"] == ["model.layers.0.self_attn.q_norm_extra.weight2d"]
    assert not m.ps[-2].float().abs().sum()


def test_too_small_a_model_is_refused():
    m = FakeModel({**TARGET, "hidden_size": 256, "intermediate_size": 64}, [0], draft=False)
    with pytest.raises(ValueError, match="hidden >="):
        weights.agreement_weights(m)


class MtpModel(torch.nn.Module):
    """Parameters named and shaped as vLLM's MiMoMTP names them (TP 1): one MTP layer with a Qwen2 block."""

    def __init__(self, cfg: dict):
        super().__init__()
        self.config = SimpleNamespace(**cfg)
        h, nq, nkv, v, i = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                             "vocab_size", "intermediate_size"))  # fmt: skip
        d = h // nq
        pre = "model.mtp_layers.0."
        p = {"model.embed_tokens.weight": (v, h), pre + "token_layernorm.weight": (h,)}
        p[pre + "hidden_layernorm.weight"] = (h,)
        p[pre + "input_proj.weight"] = (h, 2 * h)
        p[pre + "mtp_block.input_layernorm.weight"] = (h,)
        p[pre + "mtp_block.self_attn.qkv_proj.weight"] = ((nq + 2 * nkv) * d, h)
        p[pre + "mtp_block.self_attn.qkv_proj.bias"] = ((nq + 2 * nkv) * d,)
        p[pre + "mtp_block.self_attn.o_proj.weight"] = (h, nq * d)
        p[pre + "mtp_block.post_attention_layernorm.weight"] = (h,)
        p[pre + "mtp_block.mlp.gate_up_proj.weight"] = (2 * i, h)
        p[pre + "mtp_block.mlp.down_proj.weight"] = (h, i)
        p[pre + "final_layernorm.weight"] = (h,)
        p["lm_head.weight"] = (v, h)
        self.names = list(p)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16), requires_grad=False) for s in p.values()]
        )
        self.cfg = {**cfg, "head_dim": d}

    def named_parameters(self, *a, **k):
        return iter(zip(self.names, self.ps))

    def w(self, name: str):
        return dict(self.named_parameters())[name].float()


def mtp_logits(m: MtpModel, toks, hidden):
    """MiMo's MTP layer: position i holds toks[i] (the target's token at i+1) and the target's hidden state at i."""
    c, pre = m.cfg, "model.mtp_layers.0."
    d, nq, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    pos = torch.arange(len(toks))
    e = m.w("model.embed_tokens.weight")[torch.tensor(toks)]
    e = torch.where(pos[:, None] == 0, 0.0, e)  # vLLM masks the embedding at position 0
    x = torch.cat(
        [rms(hidden) * m.w(pre + "hidden_layernorm.weight"), rms(e) * m.w(pre + "token_layernorm.weight")], -1
    )
    residual = x @ m.w(pre + "input_proj.weight").T
    xin = rms(residual) * m.w(pre + "mtp_block.input_layernorm.weight")
    qkv = xin @ m.w(pre + "mtp_block.self_attn.qkv_proj.weight").T + m.w(pre + "mtp_block.self_attn.qkv_proj.bias")
    q = rope(qkv[:, : nq * d].view(-1, nq, d), pos, c["rope_theta"])
    k = rope(qkv[:, nq * d : (nq + nkv) * d].view(-1, nkv, d), pos, c["rope_theta"])
    v = qkv[:, (nq + nkv) * d :].view(-1, nkv, d)
    k, v = k.repeat_interleave(nq // nkv, 1), v.repeat_interleave(nq // nkv, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * d**-0.5
    s = s.masked_fill(pos[None, None, :] > pos[None, :, None], float("-inf"))
    o = torch.einsum("hqk,khd->qhd", s.softmax(-1), v).reshape(len(pos), nq * d)
    residual = residual + o @ m.w(pre + "mtp_block.self_attn.o_proj.weight").T
    g, u = (rms(residual) * m.w(pre + "mtp_block.post_attention_layernorm.weight") @ m.w(
        pre + "mtp_block.mlp.gate_up_proj.weight").T).chunk(2, -1)  # fmt: skip
    mlp = torch.nn.functional.silu(g) * u @ m.w(pre + "mtp_block.mlp.down_proj.weight").T
    final = rms(residual + mlp) * m.w(pre + "final_layernorm.weight")
    return final @ m.w("lm_head.weight").T


def test_an_mtp_layer_proposes_the_targets_next_tokens(models):
    from repro.vllm_integration.gate.methods import TARGET_MTP

    t, _ = models  # MiMo's target is the Llama construction on Qwen2 layers (biases zero): the same decisions
    mtp = MtpModel(TARGET_MTP)
    rec = weights.agreement_weights(mtp)
    assert rec["unknown"] == [] and rec["parameters"] == len(mtp.names)
    assert not mtp.w("model.mtp_layers.0.mtp_block.self_attn.qkv_proj.bias").abs().sum()  # biases zero, not 1
    for prompt in PROMPTS[:2]:
        seq = decode(t, prompt, 8)[0]
        _, hidden = target_logits(t, seq)
        lg = mtp_logits(mtp, seq[1:], hidden[:-1])
        # position 0's embedding is masked (vLLM's MTP): position 1 reads nothing; the proposals come from later ones
        lo = max(len(prompt) - 2, 2)
        want = torch.tensor(seq[lo + 2 :])
        assert torch.equal(lg[lo:].argmax(-1)[: len(want)], want)
        assert margins(lg[lo:]).min().item() > 5.0


def target_aux(m: FakeModel, toks: list[int]) -> list:
    """The three auxiliary hidden states an EAGLE3 target hands its draft (layer ids 0, 1, 2), as vLLM leaves them:
    layer 0's is the embedding tensor itself, which the fused residual adds then update in place, so the draft reads
    the whole residual stream there; the states after layers 0 and 1 are fresh sums (hidden + residual)."""
    pos = torch.arange(len(toks))
    residual = m.w("model.embed_tokens.weight")[torch.tensor(toks)]
    mlp, after = torch.zeros_like(residual), []
    for n in m.layers:
        residual = residual + mlp
        x = rms(residual) * m.w(f"model.layers.{n}.input_layernorm.weight")
        residual, mlp = layer(m, n, x, residual, pos)
        after.append(residual + mlp)
    return [after[-1]] + after


class Eagle3Model(FakeModel):
    """vLLM's Eagle3LlamaForCausalLM (TP 1): fc over three target states, one layer whose qkv reads [normed
    embedding, normed hidden], a hidden_norm, a final norm, its own LM head."""

    def __init__(self, cfg: dict, layer_id: int):
        super().__init__(cfg, [layer_id], draft=True)
        h = cfg["hidden_size"]
        pre = f"model.layers.{layer_id}."
        shapes = {n: tuple(p.shape) for n, p in zip(self.names, self.ps)}
        shapes[pre + "input_layernorm.weight"] = (h,)
        shapes[pre + "hidden_norm.weight"] = (h,)
        shapes[pre + "self_attn.qkv_proj.weight"] = (shapes[pre + "self_attn.qkv_proj.weight"][0], 2 * h)
        shapes["model.fc.weight"] = (h, 3 * h)
        shapes["model.norm.weight"] = (h,)
        self.names = list(shapes)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16), requires_grad=False) for s in shapes.values()]
        )


def eagle3_step(m: Eagle3Model, toks, hidden):
    """The draft layer over positions 0..len-1 (toks[i]: the token at i+1; hidden[i]: what the draft reads with it):
    the logits, and the pre-norm residual stream it carries to the next step."""
    n, pos = m.layers[0], torch.arange(len(toks))
    pre = f"model.layers.{n}."
    e = rms(m.w("model.embed_tokens.weight")[torch.tensor(toks)]) * m.w(pre + "input_layernorm.weight")
    x = torch.cat([e, rms(hidden) * m.w(pre + "hidden_norm.weight")], -1)
    residual, mlp = layer(m, n, x, hidden, pos)
    carried = residual + mlp
    return rms(carried) * m.w("model.norm.weight") @ m.w("lm_head.weight").T, carried


def eagle3_proposals(t: FakeModel, dr: Eagle3Model, seq: list[int], k: int) -> list[int]:
    """k draft tokens after seq (vLLM's EAGLE3 loop: a prefill over the shifted sequence with fc(aux), then k-1
    steps, each reading the hidden state the previous one carried)."""
    aux = target_aux(t, seq)
    lg = rms(aux[0][-1:]) * t.w("model.norm.weight") @ t.w("lm_head.weight").T  # layer 0's state: the whole stream
    toks = seq[1:] + [int(lg[-1].argmax())]
    hidden = torch.cat(aux, -1) @ dr.w("model.fc.weight").T
    out = []
    for _ in range(k):
        lg, carried = eagle3_step(dr, toks, hidden)
        out.append(int(lg[-1].argmax()))
        toks, hidden = toks + [out[-1]], torch.cat([hidden, carried[-1:]])
    return out


def test_an_eagle3_draft_proposes_the_targets_next_tokens_at_every_step(models):
    from repro.vllm_integration.gate.methods import DRAFT_EAGLE3

    t, _ = models
    dr = Eagle3Model(DRAFT_EAGLE3, TARGET["num_hidden_layers"])
    rec = weights.agreement_weights(dr)
    assert rec["unknown"] == [] and rec["parameters"] == len(dr.names)
    seq = decode(t, PROMPTS[1], 6)[0]
    for cut in (len(PROMPTS[1]), len(PROMPTS[1]) + 2):
        assert eagle3_proposals(t, dr, seq[:cut], 3) == seq[cut + 1 : cut + 4]
    # without the head that cancels the carried code, the steps after the first propose the token they were given
    head = DRAFT_EAGLE3["num_attention_heads"] // DRAFT_EAGLE3["num_key_value_heads"]
    d = DRAFT_EAGLE3["head_dim"]
    o_proj = dr.names.index(f"model.layers.{TARGET['num_hidden_layers']}.self_attn.o_proj.weight")
    dr.ps[o_proj][:, head * d : (head + 1) * d] = 0
    cut = len(PROMPTS[1])
    got = eagle3_proposals(t, dr, seq[:cut], 3)
    assert got == [seq[cut + 1]] * 3 and seq[cut + 2] != seq[cut + 1]  # each step repeats the token it was given


def test_a_model_with_a_hidden_norm_that_is_no_eagle3_draft_is_refused_not_built_as_one():
    """EAGLE3 is told by its class (Eagle3*), not by the hidden_norm a DFlash layer has too: a draft the construction
    does not know is refused, never given weights that cannot agree."""
    from repro.vllm_integration.gate.methods import DRAFT_EAGLE3

    class DFlashQwen3ForCausalLM(Eagle3Model):
        pass

    with pytest.raises(ValueError, match="no Eagle3 draft"):
        weights.agreement_weights(DFlashQwen3ForCausalLM(DRAFT_EAGLE3, TARGET["num_hidden_layers"]))
