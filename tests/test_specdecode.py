"""Target and draft models and the V2-style capture runner on CPU (reference attention, the FA3 CPU model for the
metadata, no graphs): capture order, strategy semantics, and greedy speculative decoding."""

import pytest
import torch

from repro.case.scenarios import FRESH, STALE
from repro.errors import ConfigError
from repro.fa3_model.predict import ModelBackend
from repro.specdecode.models import EagleDraft, ForwardContext, ModelConfig, TargetModel, rotary
from repro.specdecode.runner import SpecDecodeRunner

MCFG = ModelConfig(vocab=256, hidden=256, layers=2, q_heads=4, kv_heads=2, head_dim=64, intermediate=512)
ACFG = MCFG.attn_config(
    page_size=16,
    max_model_len=256,
    num_speculative_tokens=3,
    capture_sizes=(2, 4, 8, 16),
    max_num_seqs=8,
    num_splits=32,
)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def _runner(strategy, **kw):
    return SpecDecodeRunner(MCFG, ACFG, None, ModelBackend("vllm"), "cpu", strategy=strategy, use_graphs=False, **kw)


def test_models_are_seeded_and_shaped():
    a, b = TargetModel(MCFG), TargetModel(MCFG)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    d = EagleDraft(MCFG, a)
    assert d.layer.attn.qkv.weight.shape == ((4 + 2 * 2) * 64, 256)
    assert len(list(d.parameters())) < len(list(a.parameters()))  # embed and LM head are the target's


def test_rotary_preserves_norm_and_position_zero():
    x = torch.randn(3, 2, 64)
    y = rotary(x, torch.tensor([0, 5, 9]), 10000.0)
    assert torch.allclose(y[0], x[0]) and torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)


def test_capture_order_mirrors_v2():
    run = _runner(FRESH)
    ev = run.capture()
    models = [e.model for e in ev]
    assert models.index("draft-prefill") > max(i for i, m in enumerate(models) if m == "target")
    assert models.index("draft-decode") > max(i for i, m in enumerate(models) if m == "draft-prefill")
    tgt = [e.descriptor.num_tokens for e in ev if e.model == "target" and e.stage == "warmup"]
    assert tgt == sorted(tgt, reverse=True)  # largest first
    assert [e.stage for e in ev[:2]] == ["warmup", "capture"]


def test_stale_draft_prefill_runs_on_another_descriptors_buffers():
    ev = _runner(STALE).capture()
    prefill = [e for e in ev if e.model == "draft-prefill"]
    smallest = min(e.descriptor for e in prefill)
    for e in prefill:
        assert e.buffer_holds == smallest  # the target's last build
        assert e.stale == (e.descriptor != smallest)
    assert sum(e.stale for e in prefill) == 2 * (len({e.descriptor for e in prefill}) - 1)


def test_fresh_never_runs_on_another_descriptors_buffers():
    ev = _runner(FRESH).capture()
    assert not any(e.stale for e in ev)
    prefill = [e for e in ev if e.model == "draft-prefill"]
    assert len({e.view_build for e in prefill}) == len(prefill)  # a build of its own for every pass


@pytest.mark.parametrize("strategy", [STALE, FRESH])
def test_speculative_decoding_equals_greedy_target(strategy):
    run = _runner(strategy)
    run.capture()
    res = run.generate(PROMPTS, 10)
    assert res.tokens == run.greedy_reference(PROMPTS, 10)
    assert all(len(t) == 10 for t in res.tokens) and res.proposed == res.steps * len(PROMPTS) * 3


def test_acceptance_path_with_an_oracle_draft():
    """A draft that proposes the target's own continuation: every proposal is accepted, output unchanged."""
    run = _runner(FRESH)
    run.capture()
    truth = run.greedy_reference(PROMPTS, 24)
    full = [p + t for p, t in zip(PROMPTS, truth)]

    def oracle(first, hidden, start, dd):
        return [full[i][start[i] + 1 : start[i] + 1 + run.k] for i in range(len(first))]

    run._propose = oracle
    res = run.generate(PROMPTS, 12)
    assert res.tokens == [t[:12] for t in truth]
    assert res.accepted == res.proposed  # all accepted
    assert res.steps <= 12 // (run.k + 1) + 1


def test_runtime_build_refreshes_the_same_buffers():
    run = _runner(FRESH)
    from repro.case.descriptors import BatchDescriptor

    d = BatchDescriptor(8, 2, 4)
    cap = run.builder.build(d)
    run.builder.build_runtime(d, [37, 12])
    assert cap.seq_lens.tolist() == [37, 12]  # the captured view sees the runtime contents
    with pytest.raises(ConfigError):
        run.builder.build_runtime(d, [1000, 1])


def test_bad_configs():
    with pytest.raises(ConfigError):
        SpecDecodeRunner(
            MCFG, ACFG.with_(num_speculative_tokens=0), None, ModelBackend("vllm"), "cpu", use_graphs=False
        )
    with pytest.raises(ConfigError):
        SpecDecodeRunner(MCFG, ACFG.with_(num_heads_q=8), None, ModelBackend("vllm"), "cpu", use_graphs=False)


def test_forward_context_records_builds():
    run = _runner(FRESH)
    md = run.builder.build(run.verify_descs[-1])
    ctx = ForwardContext(md, run.target_kv, run.slots[:4])
    q = torch.randn(4, 4, 64)
    for i in range(2):
        run.target_kv[i][0].zero_()
    assert ctx.attend(0, q).shape == q.shape and ctx.seen == [md.build_id]


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("heads", [(4, 4), (4, 1)])
@pytest.mark.parametrize("page", [16, 32])
def test_speculative_decoding_sweep(k, heads, page):
    """Speculative tokens x GQA ratio x page size: always the target's own greedy tokens."""
    m = ModelConfig(vocab=128, hidden=128, layers=1, q_heads=heads[0], kv_heads=heads[1], head_dim=64, intermediate=256)
    a = m.attn_config(
        page_size=page,
        max_model_len=128,
        num_speculative_tokens=k,
        capture_sizes=(2, 4, 8),
        max_num_seqs=4,
        num_splits=32,
    )
    run = SpecDecodeRunner(m, a, None, ModelBackend("upstream"), "cpu", strategy=STALE, use_graphs=False)
    ev = run.capture()
    assert any(e.stale for e in ev) == (len(run.verify_descs) > 1)
    assert run.generate(PROMPTS, 8).tokens == run.greedy_reference(PROMPTS, 8)


def test_graph_vs_eager_comparison_sees_draft_proposals_the_tokens_hide():
    """compare_runs on two CPU runs: identical runs agree exactly; a run whose draft proposed other tokens (what stale
    draft metadata does) is wrong output even though greedy verification gives the same tokens."""
    from repro.specdecode.runner import compare_runs

    a, b = _runner(FRESH).generate(PROMPTS, 8), _runner(FRESH).generate(PROMPTS, 8)
    same = compare_runs(a, b)
    assert same["tokens_equal"] and same["steps"] > 0 and not same["wrong"] and same["max_logit_err"] == 0.0
    b.proposals[0] = [[t + 1 for t in row] for row in b.proposals[0]]
    moved = compare_runs(a, b)
    assert moved["wrong"] and moved["tokens_equal"] and moved["first_proposal_diff"] == 0
    b.proposals[0] = a.proposals[0]
    b.verify_logits[1] = b.verify_logits[1] + 0.5
    assert compare_runs(a, b)["max_logit_err"] == pytest.approx(0.5, abs=1e-3) and compare_runs(a, b)["wrong"]


def test_a_spec_decode_case_runs_in_the_spec_decode_layers_worker_and_never_in_the_attention_worker(
    monkeypatch, tmp_path
):
    """The runner starts a spec-decode case as repro.specdecode.worker (its main, when forked), any other scenario as
    repro.attention.worker, which refuses a spec-decode case: the attention layer runs nothing of the layer above."""
    from repro.attention import worker as attention_worker  # noqa: PLC0415  the case process's module
    from repro.case.spec import CaseSpec  # noqa: PLC0415
    from repro.run import runner  # noqa: PLC0415

    started = []
    monkeypatch.setattr(runner, "worker_env", lambda spec, mps: {})
    monkeypatch.setattr(runner, "run_process", lambda spec, cmd, *a: started.append((cmd[2], a[-1][0])) or (None,))
    runner.run_case(CaseSpec("upstream", "stale", scenario="spec-decode"), tmp_path)
    runner.run_case(CaseSpec("upstream", "stale"), tmp_path)
    assert started == [
        ("repro.specdecode.worker", "repro.specdecode.worker:main"),
        ("repro.attention.worker", "repro.attention.worker:main"),
    ]
    with pytest.raises(ValueError, match="repro.specdecode.worker"):
        attention_worker.run_case(CaseSpec("upstream", "stale", scenario="spec-decode"))


def test_the_spec_decode_worker_is_a_case_process_of_its_own(tmp_path):
    """`python -m repro.specdecode.worker SPEC` runs the attention worker's process around its case: without a GPU
    it reports the skip on the channel and exits 0, as the attention worker does."""
    import json  # noqa: PLC0415
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    from repro.case.spec import CaseSpec  # noqa: PLC0415

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "CUDA_VISIBLE_DEVICES": "", "REPRO_CHANNEL": str(tmp_path / "c.jsonl")}
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    spec = CaseSpec("upstream", "stale", scenario="spec-decode").to_json()
    p = subprocess.run(
        [sys.executable, "-m", "repro.specdecode.worker", spec], env=env, capture_output=True, timeout=120
    )
    assert p.returncode == 0, p.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines() if line.strip()]
    assert [r["tag"] for r in records] == ["REPRO_SKIP"] and "no CUDA device" in records[0]["data"]["reason"]
