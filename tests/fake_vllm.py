"""A stand-in `vllm` package written into a prefix folder, for the gate's CPU tier: the same module paths, class and
function names the repro plugin patches, and an LLM that does what vLLM does that matters here: it loads the
general plugins through their entry points, loads dummy weights with DummyModelLoader, resolves an engine
configuration (llm_engine.vllm_config: cudagraph mode, speculative config), has a V2 model runner capture FULL CUDA
graphs (target decode, then the speculator's draft prefill and draft decode managers) through torch.cuda.graph (a CPU
stand-in when there is no GPU), builds attention metadata into persistent buffers (calling get_scheduler_metadata, as
vLLM's FA3 path does), runs forwards through FlashAttentionImpl.forward (FA version 3, calling
torch.ops._vllm_fa3_C.fwd), decodes greedy tokens with per-token logprobs and exposes spec-decode counters through
LLM.get_metrics.

Behaviours (`behaviour` argument):
  good           fresh metadata everywhere
  stale-crash    the draft prefill capture reuses an overwritten target build, then an illegal memory access; with
                 CUDA_LAUNCH_BLOCKING=1 the faulting line names flash_fwd_combine_launch_template.h, as on the H200
  stale-quiet    reuses it, no fault
  stale-descriptor  the draft prefill capture builds each descriptor's metadata for the other descriptor of its
                 capture list (object and buffers consistent with each other), no fault: only the auditor's
                 descriptor check sees it
  wrong          tokens of the CUDA-graph run differ from the reference at a decided position
  broken         the speculative engine fails to start, no fault
  abort          good, but the speculative engine's process aborts (SIGABRT) after its captures
  hang           the speculative engine never finishes its captures (a helper process beside it, in its group)
  slow           good, the speculative engine's captures take SLOW_S seconds
Builds that hook nothing (the gate must not vouch for them):
  renamed        the backend classes are FlashAttnMetadataBuilder / FlashAttnImpl
  no-forward     the runner never calls FlashAttentionImpl.forward (it calls forward_impl)
  no-sched       the builder never calls get_scheduler_metadata
  other-backend  attention runs through a TritonAttentionImpl (another backend)
  fa2            FlashAttentionImpl reports FA version 2
  no-spec        the engine resolves no speculative decoding
  other-method   good, but the engine resolves the speculative method asked for to another one (draft_model, or
                 eagle when draft_model was asked)
  piecewise      the engine resolves PIECEWISE graphs: no FULL graph
  v1-runner      the model runner is the V1 one (vllm/v1/worker/gpu_model_runner.py)"""

from __future__ import annotations

import subprocess
from pathlib import Path

BEHAVIOURS = (
    "good",
    "stale-crash",
    "stale-quiet",
    "stale-descriptor",
    "wrong",
    "broken",
    "abort",
    "hang",
    "slow",
    "renamed",
    "no-forward",
    "no-sched",
    "other-backend",
    "fa2",
    "no-spec",
    "piecewise",
    "v1-runner",
    "other-method",
)

INIT = """
import importlib.metadata, json, os, sys
import torch
__version__ = "{version}"
BEHAVIOUR = "{behaviour}"

if not torch.cuda.is_available():  # a CPU stand-in for torch.cuda.graph: records nothing, runs the block
    class _CpuGraph:
        def __init__(self, cuda_graph=None, pool=None, stream=None, **kw):
            self.cuda_graph = cuda_graph

        def __enter__(self):
            return None

        def __exit__(self, *exc):
            return False

    torch.cuda.graph = _CpuGraph


class SamplingParams:
    def __init__(self, temperature=0.0, max_tokens=16, detokenize=True, ignore_eos=False, logprobs=None):
        self.max_tokens, self.logprobs = max_tokens, logprobs


class Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class _Completion:
    def __init__(self, token_ids, logprobs):
        self.token_ids, self.logprobs = token_ids, logprobs


class _Output:
    def __init__(self, token_ids, logprobs):
        self.outputs = [_Completion(token_ids, logprobs)]


class _Mode:
    def __init__(self, name):
        self.name = name


class _Ns:
    def __init__(self, **kw):
        self.__dict__.update(kw)


class _Metric:
    def __init__(self, name, value):
        self.name, self.value = name, value


class _TinyLlama(torch.nn.Module):
    # named and shaped as vLLM's Llama names its parameters (the gate's weights write them by name)

    def __init__(self):
        super().__init__()
        self.config = _Ns(
            hidden_size=512, num_attention_heads=4, num_key_value_heads=1, head_dim=128, vocab_size=512,
            rope_theta=10000.0,
        )
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(512, 512)
        self.model.norm = torch.nn.LayerNorm(512, bias=False)
        layer, attn = torch.nn.Module(), torch.nn.Module()
        attn.qkv_proj = torch.nn.Linear(512, 768, bias=False)
        attn.o_proj = torch.nn.Linear(512, 512, bias=False)
        layer.self_attn = attn
        self.model.layers = torch.nn.ModuleList([layer])
        self.lm_head = torch.nn.Linear(512, 512, bias=False)


class LLM:
    def __init__(self, **kw):
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins"):
            ep.load()()
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
        self.model = _TinyLlama()
        DummyModelLoader(None).load_weights(self.model, None)
        self.spec = "speculative_config" in kw and BEHAVIOUR != "no-spec"
        if BEHAVIOUR == "broken" and self.spec:
            raise RuntimeError("Engine core initialization failed")
        mode = "NONE" if kw.get("enforce_eager") else kw.get("compilation_config", {{}}).get("cudagraph_mode", "NONE")
        if BEHAVIOUR == "piecewise" and mode != "NONE":
            mode = "PIECEWISE"
        spec = None
        if self.spec:
            sc = kw["speculative_config"]
            method = sc["method"]
            if BEHAVIOUR == "other-method":
                method = "eagle" if method == "draft_model" else "draft_model"
            spec = _Ns(method=method, num_speculative_tokens=sc["num_speculative_tokens"])
        compiled = not kw.get("enforce_eager") and kw.get("compilation_config", {{}}).get("mode") != 0
        config = _Ns(
            compilation_config=_Ns(cudagraph_mode=_Mode(mode), mode=_Mode("VLLM_COMPILE" if compiled else "NONE")),
            speculative_config=spec,
            attention_config=_Ns(backend=_Mode(kw.get("attention_backend") or "FLASH_ATTN")),
        )
        self.llm_engine = _Ns(vllm_config=config)
        if BEHAVIOUR == "v1-runner":
            from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        else:
            from vllm.v1.worker.gpu.model_runner import GPUModelRunner
        self.graphs = mode != "NONE"
        self.runner = GPUModelRunner(self.spec, mode)
        self.runner.speculative_config = spec  # as vLLM's V2 runner holds it
        self.runner.capture_model()

    def get_metrics(self):
        if not self.spec:
            return []
        return [
            _Metric("vllm:spec_decode_num_drafts", 16),
            _Metric("vllm:spec_decode_num_draft_tokens", 48),
            _Metric("vllm:spec_decode_num_accepted_tokens", 30),
        ]

    def generate(self, prompts, params):
        self.runner.execute_model(8)
        out = []
        for i, p in enumerate(prompts):
            toks = [(p["prompt_token_ids"][-1] * 7 + j) % 4096 for j in range(params.max_tokens)]
            if self.graphs and BEHAVIOUR == "wrong" and i == 1:
                toks[3] += 1
            lps = [{{t: Logprob(-0.1), t + 1: Logprob(-2.5 if j != 5 else -0.12)}} for j, t in enumerate(toks)]
            out.append(_Output(toks, lps if params.logprobs else None))
        return out
"""

BACKEND = """
import torch
from vllm.v1.attention.backends import flash_attn
if BEHAVIOUR == "other-backend":
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl as Impl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadataBuilder as Builder
elif BEHAVIOUR == "renamed":
    Impl, Builder = flash_attn.FlashAttnImpl, flash_attn.FlashAttnMetadataBuilder
else:
    Impl, Builder = flash_attn.FlashAttentionImpl, flash_attn.FlashAttentionMetadataBuilder


def forward(impl, md, num_tokens=None):
    # query: the pass's tokens (None: not said); the kernels read as many as the metadata says
    query = None if num_tokens is None else torch.zeros(num_tokens)
    if BEHAVIOUR == "no-forward":
        return impl.forward_impl(None, query, None, None, None, md)
    return impl.forward(None, query, None, None, None, md)
"""

CUDAGRAPH_UTILS = """
import sys
import torch


class _Mode:
    def __init__(self, name):
        self.name = name


class BatchExecutionDescriptor:
    # vLLM's (cudagraph_utils.py): a FULL uniform-decode descriptor of n requests, 4 tokens each
    def __init__(self, n):
        self.cg_mode, self.num_tokens, self.num_reqs = _Mode("FULL"), 4 * n, n
        self.uniform_token_count, self.max_query_len = 4, None


class CudaGraphManager:
    def __init__(self, mode):
        self.full = mode in ("FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")

    def capture(self, create_forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        if not self.full:
            return
        print(f"{progress_bar_desc}: 100%", file=sys.stderr, flush=True)  # vLLM's progress bar (the gate's marker)
        for desc in (BatchExecutionDescriptor(8), BatchExecutionDescriptor(1)):  # larger graphs first
            run = create_forward_fn(desc, warmup=True)
            run()  # warm-up, eager
            run = create_forward_fn(desc, warmup=False)
            with torch.cuda.graph(object(), None):
                run()
"""

MODEL_RUNNER = """
import os, sys
import vllm
from vllm.v1.worker.gpu._backend import Builder, Impl, forward
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager
BEHAVIOUR = vllm.BEHAVIOUR
SLOW_S = 2.0  # long enough to kill its forkserver under it (the kill follows its start by 0.1 s)


class GPUModelRunner:
    def __init__(self, spec, mode):
        self.builder, self.impl = Builder(), Impl()
        self.cudagraph_manager = CudaGraphManager(mode)
        self.speculator = None
        if spec:
            from vllm.v1.worker.gpu.spec_decode.autoregressive.speculator import Speculator
            self.speculator = Speculator(self.builder, self.impl, mode)

    def capture_model(self):
        saved = {}

        def create(desc, warmup):
            n = desc.num_reqs
            md = self.builder.build(n)
            saved[n] = md
            return lambda: forward(self.impl, md, desc.num_tokens)

        if self.cudagraph_manager.full:  # vLLM's first capture line (the gate's marker), only where it captures
            print("Capturing CUDA graphs (PIECEWISE): 100%", file=sys.stderr, flush=True)
        self.cudagraph_manager.capture(create, "Capturing decode CUDA graphs (FULL)")
        if self.speculator is not None and self.cudagraph_manager.full:
            self.speculator.capture(saved)
        if self.cudagraph_manager.full and BEHAVIOUR == "abort":
            sys.stderr.flush()
            os.abort()
        if self.cudagraph_manager.full and BEHAVIOUR == "hang":
            import subprocess, time
            helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            print(f"stand-in hang: helper process {helper.pid}", flush=True)
            time.sleep(600)
        if self.cudagraph_manager.full and BEHAVIOUR == "slow":
            import time
            time.sleep(SLOW_S)

    def execute_model(self, n):
        forward(self.impl, self.builder.build(n), 4 * n)
"""

SPECULATOR = """
import os, sys
import vllm
from vllm.v1.worker.gpu._backend import forward
from vllm.v1.worker.gpu.spec_decode.autoregressive.cudagraph_utils import SpeculatorCudaGraphManager
BEHAVIOUR = vllm.BEHAVIOUR


class Speculator:
    def __init__(self, builder, impl, mode):
        self.builder, self.impl = builder, impl
        self.prefill_cudagraph_manager = SpeculatorCudaGraphManager(mode)
        self.decode_cudagraph_manager = SpeculatorCudaGraphManager(mode)

    def capture(self, attn_states):
        def prefill(desc, warmup):
            n = desc.num_reqs
            # stale builds reuse the target's saved metadata, whose buffers the target's later builds overwrote
            if BEHAVIOUR == "stale-descriptor":  # a fresh build, for the other descriptor of the capture list
                md = self.builder.build(1 if n == 8 else 8)
            else:
                md = attn_states[n] if BEHAVIOUR.startswith("stale") else self.builder.build(n)

            def run():
                forward(self.impl, md, desc.num_tokens)
                if BEHAVIOUR == "stale-crash":
                    if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
                        print("Capturing prefill CUDA graphs (FULL):  49%| 24/49 CUDA error "
                              "(flash_fwd_combine_launch_template.h:60): an illegal memory access was encountered",
                              file=sys.stderr)
                    else:
                        print("torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
                              file=sys.stderr)
                    sys.exit(1)

            return run

        def decode(desc, warmup):
            md = self.builder.build(desc.num_reqs)
            return lambda: forward(self.impl, md, desc.num_tokens)

        self.prefill_cudagraph_manager.capture(prefill, progress_bar_desc="Capturing prefill CUDA graphs")
        self.decode_cudagraph_manager.capture(decode, progress_bar_desc="Capturing draft decode CUDA graphs")
"""

SPEC_CUDAGRAPH = """
from vllm.v1.worker.gpu.cudagraph_utils import CudaGraphManager


class SpeculatorCudaGraphManager(CudaGraphManager):
    def capture(self, forward_fn, progress_bar_desc="Capturing CUDA graphs"):
        super().capture(forward_fn, progress_bar_desc)
"""

FLASH_ATTN = """
import os, sys
import torch
import vllm
import vllm.vllm_flash_attn._vllm_fa3_C  # noqa: F401  registers torch.ops._vllm_fa3_C
BEHAVIOUR = vllm.BEHAVIOUR
SIZES = {sizes}  # FA3 scheduler-metadata size for a batch of n (repro.backends.layout)
BUF = {{"query_start_loc": torch.zeros(17, dtype=torch.int32), "seq_lens": torch.zeros(16, dtype=torch.int32)}}


def get_scheduler_metadata(batch_size, max_seqlen_q, max_seqlen_k, headdim, causal, page_size, window_size=None,
                           sm_margin=0):
    return torch.full((SIZES[batch_size],), 5, dtype=torch.int32)


class FlashAttentionMetadata:
    def __init__(self, n):
        self.query_start_loc, self.seq_lens = BUF["query_start_loc"][: n + 1], BUF["seq_lens"][:n]
        self.scheduler_metadata, self.num_actual_tokens, self.max_query_len = None, 4 * n, 4


class FlashAttentionMetadataBuilder:
    def build(self, n):
        BUF["query_start_loc"][: n + 1] = torch.arange(n + 1) * 4
        BUF["query_start_loc"][n + 1 :] = 0
        BUF["seq_lens"][:n] = 100 + n
        BUF["seq_lens"][n:] = 0
        md = FlashAttentionMetadata(n)
        if BEHAVIOUR != "no-sched":
            get_scheduler_metadata(batch_size=n, max_seqlen_q=4, max_seqlen_k=100 + n, headdim=128, causal=True,
                                   page_size=16, window_size=None)
        return md


class FlashAttentionImpl:
    def __init__(self):
        self.vllm_flash_attn_version = 2 if BEHAVIOUR == "fa2" else 3

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        md = attn_metadata
        n = md.seq_lens.shape[0] if md is not None else 0
        # the kernels' reaction to buffers that hold another batch's contents (what the H200 showed: a fault in the
        # split-KV combine kernel), except in the build whose stale reads stay silent, or to metadata of more tokens
        # than the pass has (FA3 reads past the query: the self control's second form, except in the build whose
        # kernels stay in bounds)
        past = md is not None and query is not None and md.num_actual_tokens > query.shape[0]
        past = past and BEHAVIOUR != "stale-descriptor"
        if n and BEHAVIOUR not in ("stale-quiet", "stale-crash") and (md.seq_lens.tolist() != [100 + n] * n or past):
            if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
                print("CUDA error (flash_fwd_combine_launch_template.h:60): an illegal memory access was encountered",
                      file=sys.stderr)
            else:
                print("torch.AcceleratorError: CUDA error: an illegal memory access was encountered", file=sys.stderr)
            sys.exit(1)
        return torch.ops._vllm_fa3_C.fwd(torch.zeros(1), 0)

    forward_impl = forward


if BEHAVIOUR == "renamed":
    FlashAttnMetadataBuilder, FlashAttnImpl = FlashAttentionMetadataBuilder, FlashAttentionImpl
    del FlashAttentionMetadataBuilder, FlashAttentionImpl
"""

TRITON_ATTN = """
from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata, BUF
import torch


class TritonAttentionMetadataBuilder:
    def build(self, n):
        BUF["seq_lens"][:n] = 100 + n
        return FlashAttentionMetadata(n)


class TritonAttentionImpl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return output

    forward_impl = forward
"""

FA3_OPS = """
import torch

# torch.ops._vllm_fa3_C.fwd with sm_margin at vLLM's argument position (a CPU kernel that returns its input)
LIB = torch.library.Library("_vllm_fa3_C", "DEF")
LIB.define("fwd(Tensor q, int sm_margin) -> Tensor")
LIB.impl("fwd", lambda q, sm_margin: q.clone(), "CompositeExplicitAutograd")
"""

LOADER = """
class DummyModelLoader:
    def __init__(self, load_config):
        pass

    def load_weights(self, model, model_config):
        for p in model.parameters():
            p.data.uniform_(-1e-3, 1e-3)
"""


def write_fake_vllm(prefix: str | Path, version: str, behaviour: str) -> Path:
    from repro.backends.layout import VLLM, metadata_layout

    if behaviour not in BEHAVIOURS:
        raise ValueError(f"unknown stand-in behaviour {behaviour!r}")
    prefix = Path(prefix)
    sizes = {n: metadata_layout(VLLM, n, 1, True, False).size for n in (1, 8)}
    files = {
        "vllm/__init__.py": INIT.format(version=version, behaviour=behaviour),
        "vllm/_version.py": f'__version__ = "{version}"\n',
        "vllm/v1/__init__.py": "",
        "vllm/v1/attention/__init__.py": "",
        "vllm/v1/attention/backends/__init__.py": "",
        "vllm/v1/attention/backends/flash_attn.py": FLASH_ATTN.format(sizes=sizes),
        "vllm/v1/attention/backends/triton_attn.py": TRITON_ATTN,
        "vllm/vllm_flash_attn/__init__.py": "",
        "vllm/vllm_flash_attn/_vllm_fa3_C.py": FA3_OPS,
        "vllm/v1/worker/__init__.py": "",
        "vllm/v1/worker/gpu/__init__.py": "",
        "vllm/v1/worker/gpu/_backend.py": "import vllm\nBEHAVIOUR = vllm.BEHAVIOUR\n" + BACKEND,
        "vllm/v1/worker/gpu/cudagraph_utils.py": CUDAGRAPH_UTILS,
        "vllm/v1/worker/gpu/model_runner.py": MODEL_RUNNER,
        "vllm/v1/worker/gpu_model_runner.py": MODEL_RUNNER,
        "vllm/v1/worker/gpu/spec_decode/__init__.py": "",
        "vllm/v1/worker/gpu/spec_decode/autoregressive/__init__.py": "",
        "vllm/v1/worker/gpu/spec_decode/autoregressive/speculator.py": SPECULATOR,
        "vllm/v1/worker/gpu/spec_decode/autoregressive/cudagraph_utils.py": SPEC_CUDAGRAPH,
        "vllm/model_executor/__init__.py": "",
        "vllm/model_executor/model_loader/__init__.py": "",
        "vllm/model_executor/model_loader/dummy_loader.py": LOADER,
    }
    for rel, text in files.items():
        (prefix / rel).parent.mkdir(parents=True, exist_ok=True)
        (prefix / rel).write_text(text)
    return prefix


# Stand-ins the in-process tests share (the plugin's hooks and the source check, without a stand-in vLLM installed):


class FakeGraph:
    """torch.cuda.graph on a machine without CUDA: a context that records nothing (the capture tracker wraps it)."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


SPEC_DECODE = "vllm/v1/worker/gpu/spec_decode"
# a speculator's capture manager as the source check reads it: the bad pattern (the capture takes saved attention
# states: the draft's FULL capture runs on another descriptor's metadata, 0.21.0-0.25.1) and the fixed one (fresh
# metadata built for each descriptor, 0.26.0+)
MANAGER_BAD = """
class PrefillSpeculatorCudaGraphManager(CudaGraphManager):
    def capture(self, forward_fn, attn_states, progress_bar_desc="x"):
        def create_forward_fn(desc, warmup):
            pair = attn_states[desc]
            state = pair.warmup if warmup else pair.captured
            return forward_fn, state
        super().capture(create_forward_fn, progress_bar_desc)
"""
MANAGER_GOOD = """
class SpeculatorCudaGraphManager(CudaGraphManager):
    def capture(self, forward_fn, model_state, input_buffers, block_tables, attn_groups, kv_cache_config):
        def create_forward_fn(desc, warmup):
            md = prepare_inputs_to_capture(desc.num_reqs, desc.num_tokens, model_state, input_buffers)
            return lambda mode: forward_fn(md, mode)
        super().capture(create_forward_fn)
"""


def write_manager_tree(root: Path, layout: str, manager: str | None) -> None:
    """A vLLM source tree (for the source check, never imported) with one speculator layout's capture manager,
    `manager` (None: vllm/ alone, no spec-decode package)."""
    (root / "vllm").mkdir(parents=True, exist_ok=True)
    (root / "vllm" / "__init__.py").write_text("")
    if manager is None:
        return
    d = root / SPEC_DECODE / layout
    d.mkdir(parents=True, exist_ok=True)
    (d / "cudagraph_utils.py").write_text(manager)


def write_manager_history(repo: Path, managers: list[str]) -> list[str]:
    """A git checkout of a vLLM source tree whose autoregressive capture manager changes commit by commit: first
    MANAGER_GOOD ("good 1"), then each text of `managers` ("change 0", "change 1", ...). Their commits' shas."""

    def git(*args: str) -> str:
        cmd = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t", *args]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    write_manager_tree(repo, "autoregressive", MANAGER_GOOD)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "good 1")
    shas = []
    for i, text in enumerate(managers):
        (repo / SPEC_DECODE / "autoregressive" / "cudagraph_utils.py").write_text(text)
        git("commit", "-qam", f"change {i}")
        shas.append(git("rev-parse", "HEAD"))
    return shas
