"""A stand-in `vllm` package written into a prefix folder, for the gate's CPU tier: the same module paths, class and
function names the repro plugin patches, and an LLM that does what vLLM does that matters here: it loads the
general plugins through their entry points, loads dummy weights with DummyModelLoader, builds attention metadata into
persistent buffers and runs forwards with it, and decodes greedy tokens with per-token logprobs.

Behaviours (`behaviour` argument): good (fresh metadata), stale-crash (the draft reuses an overwritten build, then an
illegal memory access; with CUDA_LAUNCH_BLOCKING=1 the error names flash_fwd_combine), stale-quiet (reuses it, no
fault), wrong (tokens of the speculative run differ from the reference at a decided position), broken (the
speculative engine fails to start, no fault)."""

from __future__ import annotations

from pathlib import Path

INIT = """
import importlib.metadata, json, os, sys
import torch
__version__ = "{version}"
BEHAVIOUR = "{behaviour}"


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


class LLM:
    def __init__(self, **kw):
        for ep in importlib.metadata.entry_points(group="vllm.general_plugins"):
            ep.load()()
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.LayerNorm(8))
        DummyModelLoader(None).load_weights(self.model, None)
        self.spec = "speculative_config" in kw
        if BEHAVIOUR == "broken" and self.spec:
            raise RuntimeError("Engine core initialization failed")

    def generate(self, prompts, params):
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl, FlashAttentionMetadataBuilder
        b, impl = FlashAttentionMetadataBuilder(), FlashAttentionImpl()
        if self.spec:
            saved = b.build(8)  # target capture, largest first
            b.build(1)          # ... the target's last build overwrites the persistent buffers
            md = saved if BEHAVIOUR.startswith("stale") else b.build(8)
            impl.forward(None, None, None, None, None, md)  # the draft's eager warmup
            if BEHAVIOUR == "stale-crash":
                if os.environ.get("CUDA_LAUNCH_BLOCKING") == "1":
                    print("  File flash_fwd_combine_launch_template.h, line 60", file=sys.stderr)
                print("torch.AcceleratorError: CUDA error: an illegal memory access was encountered", file=sys.stderr)
                sys.exit(1)
        out = []
        for i, p in enumerate(prompts):
            toks = [(p["prompt_token_ids"][-1] * 7 + j) % 4096 for j in range(params.max_tokens)]
            if self.spec and BEHAVIOUR == "wrong" and i == 1:
                toks[3] += 1
            lps = [{{t: Logprob(-0.1), t + 1: Logprob(-2.5 if j != 5 else -0.12)}} for j, t in enumerate(toks)]
            out.append(_Output(toks, lps if params.logprobs else None))
        return out
"""

FLASH_ATTN = """
import torch
BUF = {"query_start_loc": torch.zeros(17, dtype=torch.int32), "seq_lens": torch.zeros(16, dtype=torch.int32)}


def get_scheduler_metadata(**kw):
    return None


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
        return FlashAttentionMetadata(n)


class FlashAttentionImpl:
    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output=None):
        return output
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
    prefix = Path(prefix)
    files = {
        "vllm/__init__.py": INIT.format(version=version, behaviour=behaviour),
        "vllm/_version.py": f'__version__ = "{version}"\n',
        "vllm/v1/__init__.py": "",
        "vllm/v1/attention/__init__.py": "",
        "vllm/v1/attention/backends/__init__.py": "",
        "vllm/v1/attention/backends/flash_attn.py": FLASH_ATTN,
        "vllm/model_executor/__init__.py": "",
        "vllm/model_executor/model_loader/__init__.py": "",
        "vllm/model_executor/model_loader/dummy_loader.py": LOADER,
    }
    for rel, text in files.items():
        (prefix / rel).parent.mkdir(parents=True, exist_ok=True)
        (prefix / rel).write_text(text)
    return prefix
