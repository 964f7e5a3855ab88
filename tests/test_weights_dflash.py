"""The DFlash draft's `agree` weights (repro.vllm_integration.plugin.weights_dflash) in a CPU re-implementation
of vLLM 0.34.0's DFlash step (DFlashQwen3ForCausalLM under DFlashSpeculator): each layer's context K/V from the
target's aux hidden states (fc, hidden_norm, that layer's K/V rows, k_norm, neox RoPE at the context positions), the
block's queries (the bonus token, then mask tokens) attending non-causally to the context and to each other, Qwen3's
per-head q/k norms, pre-norm layers with their SiLU MLPs, the final norm and the target's shared embedding and LM head;
with the gate's pair (gate.methods TARGET / DRAFT_DFLASH) in bf16. Every block position of the gate's k=3 (and of k=4)
proposes the target's token by a margin; a context read from another request proposes tokens the target rejects."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")

from repro.vllm_integration.gate.methods import DRAFT_DFLASH, TARGET  # noqa: E402
from repro.vllm_integration.gate.worker import PROMPTS  # noqa: E402
from repro.vllm_integration.plugin import weights, weights_dflash  # noqa: E402
from tests.test_weights import FakeModel, layer, margins, rms, rope, target_logits  # noqa: E402

K = 3  # the gate's num_speculative_tokens: a block of 1 + K queries


class DFlashModel(torch.nn.Module):
    """Parameters named and shaped as vLLM's DFlashQwen3ForCausalLM names them (TP 1; its layers numbered after the
    target's: start_layer_id)."""

    def __init__(self, cfg: dict, first_layer: int):
        super().__init__()
        self.config = SimpleNamespace(**cfg)
        h, d, nq, nkv, v, i = (cfg[k] for k in ("hidden_size", "head_dim", "num_attention_heads",
                                                "num_key_value_heads", "vocab_size", "intermediate_size"))  # fmt: skip
        aux = len(cfg["dflash_config"]["target_layer_ids"])
        p = {"model.embed_tokens.weight": (v, h), "model.mask_embedding": (h,)}
        self.pres = [f"model.layers.{first_layer + n}." for n in range(cfg["num_hidden_layers"])]
        for pre in self.pres:
            p[pre + "input_layernorm.weight"] = (h,)
            p[pre + "self_attn.qkv_proj.weight"] = ((nq + 2 * nkv) * d, h)
            p[pre + "self_attn.q_norm.weight"] = (d,)
            p[pre + "self_attn.k_norm.weight"] = (d,)
            p[pre + "self_attn.o_proj.weight"] = (h, nq * d)
            p[pre + "post_attention_layernorm.weight"] = (h,)
            p[pre + "mlp.gate_up_proj.weight"] = (2 * i, h)
            p[pre + "mlp.down_proj.weight"] = (h, i)
        p["model.fc.weight"] = (h, aux * h)
        p["model.hidden_norm.weight"] = (h,)
        p["model.norm.weight"] = (h,)
        p["lm_head.weight"] = (v, h)
        self.names = list(p)
        self.ps = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.randn(s).to(torch.bfloat16), requires_grad=False) for s in p.values()]
        )
        self.cfg, self.cache = cfg, {}

    def named_parameters(self, *a, **k):
        return iter(zip(self.names, self.ps))

    def w(self, name: str):  # float32 copies, made once (the construction is written before the first read)
        if name not in self.cache:
            self.cache[name] = dict(self.named_parameters())[name].float()
        return self.cache[name]


def target_aux(t: FakeModel, toks: list[int], layer_ids: list[int]):
    """The target's residual stream after each of layer_ids (DFlash's target_layer_ids: "after layer i")."""
    pos = torch.arange(len(toks))
    residual = t.w("model.embed_tokens.weight")[torch.tensor(toks)]
    mlp = torch.zeros_like(residual)
    after = {}
    for n in t.layers:
        residual = residual + mlp
        x = rms(residual) * t.w(f"model.layers.{n}.input_layernorm.weight")
        residual, mlp = layer(t, n, x, residual, pos)
        after[n] = residual + mlp
    return torch.cat([after[i] for i in layer_ids], -1)


def _heads(m: DFlashModel, pre: str, x, pos, part: str):
    c = m.cfg
    d, nq, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    y = x @ m.w(pre + "self_attn.qkv_proj.weight").T
    if part == "q":
        q = rms(y[:, : nq * d].view(-1, nq, d)) * m.w(pre + "self_attn.q_norm.weight")
        return rope(q, pos, c["rope_theta"])
    k = rms(y[:, nq * d : (nq + nkv) * d].view(-1, nkv, d)) * m.w(pre + "self_attn.k_norm.weight")
    return rope(k, pos, c["rope_theta"]), y[:, (nq + nkv) * d :].view(-1, nkv, d)


def dflash_block(m: DFlashModel, shared: dict, ctx_aux, bonus: int, q0: int, k: int = K):
    """One DFlash step: context = the target's aux states at positions 0..q0-1; queries at q0..q0+k hold the bonus
    token, then the mask token. Returns the block's logits [1 + k, vocab]; shared: the target's embedding and LM
    head, which the draft uses (vLLM shares them: the dummy loader never marks the draft's own)."""
    c = m.cfg
    d, nq, nkv = c["head_dim"], c["num_attention_heads"], c["num_key_value_heads"]
    ctx = rms(ctx_aux @ m.w("model.fc.weight").T) * m.w("model.hidden_norm.weight")  # every layer's context rows
    cpos, qpos = torch.arange(len(ctx)), torch.arange(q0, q0 + 1 + k)
    stream = shared["embed"][torch.tensor([bonus] + [c["dflash_config"]["mask_token_id"]] * k)]
    for pre in m.pres:
        x = rms(stream) * m.w(pre + "input_layernorm.weight")
        (ck, cv), (qk, qv) = _heads(m, pre, ctx, cpos, "kv"), _heads(m, pre, x, qpos, "kv")
        keys, vals = torch.cat([ck, qk]), torch.cat([cv, qv])  # non-causal: every query sees context and block
        keys, vals = keys.repeat_interleave(nq // nkv, 1), vals.repeat_interleave(nq // nkv, 1)
        s = torch.einsum("qhd,khd->hqk", _heads(m, pre, x, qpos, "q"), keys) * d**-0.5
        o = torch.einsum("hqk,khd->qhd", s.softmax(-1), vals).reshape(len(qpos), nq * d)
        stream = stream + o @ m.w(pre + "self_attn.o_proj.weight").T
        g, u = (rms(stream) * m.w(pre + "post_attention_layernorm.weight") @ m.w(
            pre + "mlp.gate_up_proj.weight").T).chunk(2, -1)  # fmt: skip
        stream = stream + torch.nn.functional.silu(g) * u @ m.w(pre + "mlp.down_proj.weight").T
    return (rms(stream) * m.w("model.norm.weight")) @ shared["lm_head"].T


def rule_sequence(prompt: list[int], n: int) -> list[int]:
    """The prompt and n tokens of the target's rule x(P) = SIGMA[x(P-2)] (tests/test_weights: its model decodes it)."""
    s, seq = weights.sigma(TARGET["vocab_size"]), list(prompt)
    for _ in range(n):
        seq.append(s[seq[-2]])
    return seq


# under xdist, every test reading it runs on one worker (conftest's SHARED_FIXTURE): it runs once
@pytest.fixture(scope="module")
def pair():
    t = FakeModel({**TARGET}, list(range(TARGET["num_hidden_layers"])), draft=False)
    assert weights.agreement_weights(t)["unknown"] == []
    floats, read = {}, t.w  # the target's float32 copies, made once (its weights are written)
    t.w = lambda name: floats[name] if name in floats else floats.setdefault(name, read(name))
    dr = DFlashModel(DRAFT_DFLASH, TARGET["num_hidden_layers"])
    rec = weights_dflash.dflash_weights(dr)
    assert rec["unknown"] == [] and rec["parameters"] == len(dr.names) and rec["construction"] == "dflash"
    shared = {"embed": t.w("model.embed_tokens.weight"), "lm_head": t.w("lm_head.weight")}
    seqs = [rule_sequence(p, 9) for p in PROMPTS]
    for p, seq in zip(PROMPTS, seqs):  # what the target decodes greedily (one forward over the whole sequence)
        assert target_logits(t, seq)[0][len(p) - 1 : -1].argmax(-1).tolist() == seq[len(p) :]
    return SimpleNamespace(t=t, dr=dr, shared=shared, seqs=seqs)


def steps(pair, seq: list[int], prompt_len: int, ctx_from=None, k: int = K):
    """(anchor, block logits) for every anchor whose block lies in seq's decoded part; ctx_from: another request's
    aux states as the context (what a stale block table or seq_lens reads)."""
    aux = target_aux(pair.t, seq, DRAFT_DFLASH["dflash_config"]["target_layer_ids"])
    for q0 in range(prompt_len, len(seq) - k):
        ctx = (ctx_from if ctx_from is not None else aux)[:q0]
        yield q0, dflash_block(pair.dr, pair.shared, ctx, seq[q0], q0, k)


@pytest.mark.parametrize("k", [K, 4])
def test_every_dflash_block_position_proposes_the_targets_token_by_a_margin(pair, k):
    mask = DRAFT_DFLASH["dflash_config"]["mask_token_id"]
    proposed = 0
    for prompt, seq in zip(PROMPTS, pair.seqs):
        assert mask not in seq  # the target never decodes the mask token (the pad id)
        for q0, lg in steps(pair, seq, len(prompt), k=k):
            want = torch.tensor(seq[q0 + 1 : q0 + 1 + k])
            got = lg[1:].argmax(-1)  # position 0 holds the bonus token: positions 1..k are the drafts
            assert torch.equal(got, want), (prompt, q0, got, want)
            assert margins(lg[1:].log_softmax(-1)).min().item() > 5.0
            proposed += k
    assert proposed >= 15 * k


def test_a_dflash_context_read_from_another_request_proposes_rejected_tokens(pair):
    seqs = pair.seqs
    other = target_aux(pair.t, seqs[1], DRAFT_DFLASH["dflash_config"]["target_layer_ids"])
    first = wrong = total = 0
    for q0, lg in steps(pair, seqs[0], len(PROMPTS[0]), ctx_from=other):
        if q0 > len(seqs[1]):
            break
        got, want = lg[1:].argmax(-1), torch.tensor(seqs[0][q0 + 1 : q0 + 1 + K])
        first += int(got[0] != want[0])  # position 1 reads the context two back: the first draft token rejected
        wrong += int((got != want).sum())
        total += 1
    assert total >= 3 and first == total and wrong >= 0.9 * total * K


def test_dflash_head0_reads_two_back_and_the_nearest_rival_is_far_below():
    d, theta = DRAFT_DFLASH["head_dim"], DRAFT_DFLASH["rope_theta"]
    _, k = weights.head0_query_key(d, theta)
    q = weights_dflash.query_back(d, theta, weights_dflash.DFLASH_BACK)
    norm = (weights.SCORE_NORM2 / d) ** 0.5  # the q_norm / k_norm weights dflash_weights writes
    qn, kn = rms(q.float()) * norm, rms(k.float()) * norm
    m = 600  # a query in the middle: keys before and after it (non-causal)
    pos = torch.arange(2 * m)
    qm = rope(qn[None, None, :], torch.tensor([m]), theta)[0, 0]
    ks = rope(kn[None, :].expand(len(pos), 1, d).clone(), pos, theta)[:, 0]
    s = ks @ qm * d**-0.5
    assert int(s.argmax()) == m - weights_dflash.DFLASH_BACK
    rival = torch.cat([s[: m - 2], s[m - 1 :]]).max()
    assert (s[m - 2] - rival).item() > 5.0
    assert abs(s[m - 2].item() - weights.SCORE_NORM2 * d**-0.5) < 0.5  # the target's score scale, after the norms


def test_install_writes_the_dflash_construction_for_a_dflash_draft_and_agree_for_others():
    calls = []

    class Loader:
        def load_weights(self, model, model_config):
            calls.append(type(model).__name__)

    emitted = []
    weights.install(Loader, weights.AGREE, emitted.append, weights_dflash.BY_MODEL)
    draft = type("DFlashQwen3ForCausalLM", (DFlashModel,), {})(DRAFT_DFLASH, TARGET["num_hidden_layers"])
    target = FakeModel({**TARGET}, [0, 1], draft=False)
    Loader().load_weights(draft, None)
    Loader().load_weights(target, None)
    assert calls == ["DFlashQwen3ForCausalLM", "FakeModel"]  # vLLM's dummy fill first, then the construction
    assert [e.get("construction") for e in emitted] == ["dflash", None]
    assert all(e["unknown"] == [] for e in emitted)
    norm = draft.w(draft.pres[0] + "self_attn.q_norm.weight")
    assert torch.allclose(
        norm, torch.full_like(norm, (weights.SCORE_NORM2 / DRAFT_DFLASH["head_dim"]) ** 0.5), rtol=1e-2
    )
