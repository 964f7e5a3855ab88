"""A capture runner that mirrors vLLM's V2 model runner, and a greedy speculative-decoding loop on top of it.

Capture: the target's FULL uniform-decode graphs (largest first: an eager warmup, then the captured pass), then the
draft's prefill graphs (query length 1 + k), then its decode graphs (query length 1), all in one graph pool.
stale: the draft prefill reuses the attention states saved from the target's capture (vLLM before PR #48261);
fresh: every warmup and capture pass builds its own metadata through the shared builder and buffers (after).
Runtime: every step refreshes the persistent buffers with a runtime build before it replays (or runs eagerly)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from repro.attention.builder import AttnMetadata, MetadataBuilder
from repro.case.descriptors import AttnConfig, BatchDescriptor, full_decode_descriptors
from repro.case.scenarios import FRESH, check_strategy, v2_capture_sequence
from repro.errors import ConfigError
from repro.specdecode.models import EagleDraft, ForwardContext, ModelConfig, TargetModel


@dataclass
class CaptureEvent:
    model: str  # target | draft-prefill | draft-decode
    descriptor: BatchDescriptor
    stage: str  # warmup | capture
    view_build: int
    buffer_holds: BatchDescriptor  # whose build the persistent buffers hold when the pass runs

    @property
    def stale(self) -> bool:
        return self.buffer_holds != self.descriptor


@dataclass
class Graph:
    graph: Any
    outputs: tuple[torch.Tensor, torch.Tensor]


@dataclass
class DecodeResult:
    tokens: list[list[int]]
    steps: int
    accepted: int
    proposed: int
    seconds: float
    replays: int = 0
    generated: int = 0
    events: list = field(default_factory=list)
    proposals: list = field(default_factory=list)  # per verify step: each request's k draft tokens
    verify_logits: list = field(default_factory=list)  # per verify step: the target's logits (CPU, fp32)

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds if self.seconds else 0.0


class SpecDecodeRunner:
    def __init__(
        self,
        mcfg: ModelConfig,
        acfg: AttnConfig,
        backend: Any,
        metadata_backend: Any,
        device: Any,
        strategy: str = FRESH,
        sm_margin: int = 0,
        poison: Any = None,
        dtype: Any = torch.float32,
        use_graphs: bool = True,
    ) -> None:
        check_strategy(strategy)
        if acfg.num_heads_q != mcfg.q_heads or acfg.num_heads_kv != mcfg.kv_heads or acfg.head_dim != mcfg.head_dim:
            raise ConfigError("attention config does not match the model's heads")
        self.mcfg, self.acfg, self.backend, self.device = mcfg, acfg, backend, torch.device(device)
        self.strategy, self.sm_margin, self.dtype, self.use_graphs = strategy, sm_margin, dtype, use_graphs
        self.k = acfg.num_speculative_tokens
        if self.k < 1:
            raise ConfigError("speculative decoding needs at least one speculative token")
        self.target = TargetModel(mcfg).to(self.device, dtype).eval()
        self.draft = EagleDraft(mcfg, self.target).to(self.device, dtype).eval()
        self.builder = MetadataBuilder(metadata_backend, acfg, self.device, sm_margin=sm_margin, poison=poison)
        pages, ps = self.builder.num_pages, acfg.page_size
        shape = (pages, ps, mcfg.kv_heads, mcfg.head_dim)

        def mk() -> tuple[torch.Tensor, torch.Tensor]:
            return torch.zeros(shape, device=self.device, dtype=dtype), torch.zeros(
                shape, device=self.device, dtype=dtype
            )

        self.target_kv = [mk() for _ in range(mcfg.layers)]
        self.draft_kv = [mk()]
        mt = acfg.max_batch * acfg.decode_query_len
        self.input_ids = torch.zeros(mt, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(mt, dtype=torch.long, device=self.device)
        self.slots = torch.zeros(mt, dtype=torch.long, device=self.device)
        self.hidden_in = torch.zeros(mt, mcfg.hidden, dtype=dtype, device=self.device)
        self.verify_descs = full_decode_descriptors(acfg)
        self.decode_descs = full_decode_descriptors(acfg.with_(num_speculative_tokens=0))
        self.graphs: dict[tuple[str, BatchDescriptor], Graph] = {}
        self.events: list[CaptureEvent] = []
        self.pool = torch.cuda.graph_pool_handle() if use_graphs else None
        self.replays = 0
        self.on_pass: Any = None  # called with each CaptureEvent before its pass runs

    # ---- forwards over the persistent input buffers ----
    def _ctx(self, md: AttnMetadata, kv, n: int) -> ForwardContext:
        return ForwardContext(md, kv, self.slots[:n], self.backend, self.sm_margin)

    def _target_fwd(self, md: AttnMetadata):
        n = md.descriptor.num_tokens
        return self.target(self.input_ids[:n], self.positions[:n], self._ctx(md, self.target_kv, n))

    def _draft_fwd(self, md: AttnMetadata):
        n = md.descriptor.num_tokens
        return self.draft(self.input_ids[:n], self.hidden_in[:n], self.positions[:n], self._ctx(md, self.draft_kv, n))

    def _fwd(self, model: str, md: AttnMetadata):
        return self._target_fwd(md) if model == "target" else self._draft_fwd(md)

    # ---- capture, as CudaGraphManager.capture does it ----
    def _pass(self, model: str, d: BatchDescriptor, stage: str, md: AttnMetadata) -> None:
        holder = self.builder.last_build[1]
        ev = CaptureEvent(model, d, stage, md.build_id, holder)
        self.events.append(ev)
        if self.on_pass:
            self.on_pass(ev)
        n = d.num_tokens
        self.input_ids[:n].zero_()
        self.positions[:n].zero_()
        self.slots[:n].zero_()
        with torch.inference_mode():
            if stage == "warmup" or not self.use_graphs:
                self._fwd(model, md)
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                return
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self.pool):
                out = self._fwd(model, md)
            self.graphs[(model, d)] = Graph(g, out)

    def capture(self) -> list[CaptureEvent]:
        for p in v2_capture_sequence(self.builder, self.strategy, self.verify_descs, with_target=True):
            self._pass(p.model, p.descriptor, p.stage, p.metadata)
        for d in self.decode_descs:
            self._pass("draft-decode", d, "warmup", self.builder.build(d))
            self._pass("draft-decode", d, "capture", self.builder.build(d))
        return self.events

    # ---- runtime ----
    def _slot(self, req: int, pos: int) -> int:
        return (
            int(self.builder.block_table[req, pos // self.acfg.page_size]) * self.acfg.page_size
            + pos % self.acfg.page_size
        )

    def _load(self, ids: list[int], pos: list[list[int]]) -> None:
        flat = [p for ps in pos for p in ps]
        n = len(flat)
        self.input_ids[:n] = torch.tensor(ids, dtype=torch.long, device=self.device)
        self.positions[:n] = torch.tensor(flat, dtype=torch.long, device=self.device)
        self.slots[:n] = torch.tensor(
            [self._slot(r, p) for r, ps in enumerate(pos) for p in ps], dtype=torch.long, device=self.device
        )

    def _run(self, model: str, d: BatchDescriptor, seq_lens: list[int]):
        md = self.builder.build_runtime(d, seq_lens)
        g = self.graphs.get((model, d)) if self.use_graphs else None
        with torch.inference_mode():
            if g is not None:
                g.graph.replay()
                self.replays += 1
                return g.outputs
            return self._fwd(model, md)

    def generate(self, prompts: list[list[int]], max_new: int) -> DecodeResult:
        """Greedy speculative decoding: the draft proposes k tokens, the target verifies them in one pass."""
        r, k, q = len(prompts), self.k, self.k + 1
        vd = BatchDescriptor(r * q, r, q)
        dd = BatchDescriptor(r, r, 1)
        if r > self.acfg.max_batch:
            raise ConfigError(f"{r} requests over max batch {self.acfg.max_batch}")
        if max(len(p) for p in prompts) + max_new + q >= self.acfg.max_model_len:
            raise ConfigError("prompt + max_new exceeds max_model_len")
        t0 = time.perf_counter()
        h, first, last, pd = self._prefill(prompts)
        lens = [len(p) for p in prompts]
        seqs = [list(p) + [t] for p, t in zip(prompts, first)]
        # the draft's first proposals: its prefill over the prompts (EAGLE: token p+1 with hidden p)
        self._load([t for s in seqs for t in s[1:]], [list(range(n)) for n in lens])
        self.hidden_in[: pd.num_tokens] = h
        with torch.inference_mode():
            dh, dl = self._draft_fwd(self.builder.build_runtime(pd, lens))
        drafts = self._propose(dl[last].argmax(-1).tolist(), dh[last], [n for n in lens], dd)
        steps = accepted = proposed = 0
        trace_props, trace_logits = [], []
        while min(len(s) - n for s, n in zip(seqs, lens)) < max_new:
            L = [len(s) - 1 for s in seqs]  # position of each request's last token
            ids = [t for i in range(r) for t in [seqs[i][-1], *drafts[i]]]
            pos = [list(range(L[i], L[i] + q)) for i in range(r)]
            sl = [L[i] + q for i in range(r)]
            self._load(ids, pos)
            th, tl = self._run("target", vd, sl)
            trace_props.append([list(d) for d in drafts])
            trace_logits.append(tl[: r * q].float().cpu())
            g = tl[: r * q].argmax(-1).view(r, q).tolist()
            acc = []
            for i in range(r):
                a = 0
                while a < k and drafts[i][a] == g[i][a]:
                    a += 1
                acc.append(a)
                seqs[i] += g[i][: a + 1]
            steps += 1
            accepted += sum(acc)
            proposed += r * k
            # draft prefill over the verified rows: token at L+j+1 (= g[j] where accepted) with target hidden at L+j
            self._load([t for row in g for t in row], pos)
            self.hidden_in[: r * q] = th[: r * q]
            dh, dl = self._run("draft-prefill", vd, sl)
            rows = torch.tensor([i * q + acc[i] for i in range(r)], device=self.device)
            drafts = self._propose(dl[rows].argmax(-1).tolist(), dh[rows], [L[i] + acc[i] + 1 for i in range(r)], dd)
        out = [s[n : n + max_new] for s, n in zip(seqs, lens)]
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        res = DecodeResult(out, steps, accepted, proposed, time.perf_counter() - t0, self.replays, r * max_new)
        res.proposals, res.verify_logits = trace_props, trace_logits
        return res

    def _propose(
        self, first: list[int], hidden: torch.Tensor, start: list[int], dd: BatchDescriptor
    ) -> list[list[int]]:
        """k draft tokens per request: the first from the prefill, k-1 more from draft decode steps."""
        drafts = [[t] for t in first]
        h = hidden
        for s in range(1, self.k):
            pos = [[start[i] + s - 1] for i in range(len(first))]
            self._load([d[-1] for d in drafts], pos)
            self.hidden_in[: len(first)] = h
            dh, dl = self._run("draft-decode", dd, [p[0] + 1 for p in pos])
            h = dh[: len(first)].clone()
            for i, t in enumerate(dl[: len(first)].argmax(-1).tolist()):
                drafts[i].append(t)
        return drafts

    def _prefill(self, prompts: list[list[int]]):
        """The target's eager prompt prefill (variable lengths): hidden states, each request's first token, the
        rows of the prompts' last positions, and the batch descriptor."""
        lens = [len(p) for p in prompts]
        pd = BatchDescriptor.varlen(lens)
        self._load([t for p in prompts for t in p], [list(range(n)) for n in lens])
        with torch.inference_mode():
            h, logits = self._target_fwd(self.builder.build_runtime(pd, lens))
        last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(prompts))], device=self.device)
        return h, logits[last].argmax(-1).tolist(), last, pd

    def greedy_reference(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        """Plain greedy decoding with the target alone, eager: what speculative decoding must reproduce."""
        r = len(prompts)
        lens = [len(p) for p in prompts]
        _, first, _, _ = self._prefill(prompts)
        seqs = [list(p) + [t] for p, t in zip(prompts, first)]
        with torch.inference_mode():
            dd = BatchDescriptor(r, r, 1)
            for _ in range(max_new - 1):
                pos = [[len(s) - 1] for s in seqs]
                self._load([s[-1] for s in seqs], pos)
                _, logits = self._target_fwd(self.builder.build_runtime(dd, [p[0] + 1 for p in pos]))
                for i, t in enumerate(logits[:r].argmax(-1).tolist()):
                    seqs[i].append(t)
        return [s[n:] for s, n in zip(seqs, lens)]


LOGIT_RTOL = 1e-2  # of the largest logit: bf16 rounding of one accumulation order against another


def compare_runs(graph: DecodeResult, eager: DecodeResult) -> dict:
    """What the kernels produced in a graph-replay run against an eager run of the same prompts: tokens, the draft's
    proposals at every verify step, and the target's verify logits at the steps both runs fed the same tokens.
    Stale draft metadata shows up as different proposals even where the target's verification hides it in the tokens.
    Fresh metadata runs the same kernels on the same metadata: proposals and tokens must be equal, logits within
    LOGIT_RTOL of the largest logit."""
    steps = min(len(graph.proposals), len(eager.proposals))
    differ = [s for s in range(steps) if graph.proposals[s] != eager.proposals[s]]
    same_inputs = [
        s for s in range(steps) if s not in differ and graph.verify_logits[s].shape == eager.verify_logits[s].shape
    ]
    logit_err = max(
        (float((graph.verify_logits[s] - eager.verify_logits[s]).abs().max()) for s in same_inputs), default=0.0
    )
    scale = max((float(eager.verify_logits[s].abs().max()) for s in same_inputs), default=0.0)
    tol = LOGIT_RTOL * scale
    tokens_equal = graph.tokens == eager.tokens
    return {
        "tokens_equal": tokens_equal,
        "steps": steps,
        "proposal_steps_differ": len(differ),
        "first_proposal_diff": differ[0] if differ else None,
        "max_logit_err": logit_err,
        "logit_tolerance": tol,
        "wrong": not tokens_equal or bool(differ) or len(graph.proposals) != len(eager.proposals) or logit_err > tol,
    }
