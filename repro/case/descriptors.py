"""Attention shapes and batch descriptors, and the FULL uniform-decode capture plan vLLM's V2 runner uses."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from repro.backends.layout import round_up
from repro.errors import ConfigError

# No GPU this harness runs on holds more (an H200: 141 GB). A shape whose buffers need more is impossible: refused
# before anything is allocated (the CPU model allocates the block table too).
MAX_DEVICE_BYTES = 141 * 10**9


@dataclass(frozen=True)
class AttnConfig:
    """The attention layer and the engine limits a case runs with (vLLM's names where they exist)."""

    num_heads_q: int = 32
    num_heads_kv: int = 8
    head_dim: int = 128
    page_size: int = 16
    max_model_len: int = 4096
    causal: bool = True
    window_left: int = -1  # sliding window (left), -1 = none
    num_splits: int = 32  # vLLM's flash_attn_max_num_splits_for_cuda_graph; 0 = FA3's heuristic
    num_speculative_tokens: int = 3
    capture_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    max_num_seqs: int = 64

    def __post_init__(self) -> None:
        checks = [
            (self.num_heads_q > 0 and self.num_heads_kv > 0, "head counts must be positive"),
            (self.num_heads_q % self.num_heads_kv == 0, "num_heads_q must be a multiple of num_heads_kv"),
            (self.head_dim in (64, 96, 128, 192, 256), "head_dim must be one of 64, 96, 128, 192, 256"),
            (self.page_size > 0 and self.page_size % 16 == 0, "page_size must be a positive multiple of 16"),
            (self.max_model_len >= self.decode_query_len, "max_model_len is smaller than one decode step"),
            (self.window_left >= -1, "window_left must be -1 (no window) or >= 0"),
            (self.num_splits >= 0, "num_splits must be >= 0 (0 = FA3 heuristic)"),
            (self.num_speculative_tokens >= 0, "num_speculative_tokens must be >= 0"),
            (len(self.capture_sizes) > 0 and min(self.capture_sizes) > 0, "capture_sizes must be positive"),
            (self.max_num_seqs > 0, "max_num_seqs must be positive"),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        need = self.device_bytes()
        if need > MAX_DEVICE_BYTES:
            raise ConfigError(
                f"this shape needs {need / 1e9:,.0f} GB of GPU memory (K and V caches for {self.max_batch} requests of "
                f"{self.max_model_len} tokens with {self.num_heads_kv} KV heads x {self.head_dim}, and the queries), "
                f"more than any GPU holds (an H200: {MAX_DEVICE_BYTES / 1e9:.0f} GB): lower --max-model-len, "
                "--max-num-seqs, --capture-sizes, --page-size or the head counts"
            )

    def device_bytes(self) -> int:
        """What a case of this shape allocates on the GPU, at least: K and V caches in bf16 (every request owns
        max_blocks_per_seq pages), and a full batch's queries and output in bf16 with their fp32 reference."""
        pages = self.max_batch * self.max_blocks_per_seq
        kv = 2 * pages * self.page_size * self.num_heads_kv * self.head_dim * 2
        q = self.max_batch * self.decode_query_len * self.num_heads_q * self.head_dim * (2 + 2 + 4)
        return kv + q

    def id_parts(self) -> list[str]:
        """Case-id parts for every field that differs from the defaults (heads, head size and splits are always in
        the id: repro.case.spec.CaseSpec.case_id)."""
        default = AttnConfig()
        labels = (
            ("page_size", lambda v: f"page{v}"),
            ("max_model_len", lambda v: f"len{v}"),
            ("causal", lambda v: "causal" if v else "noncausal"),
            ("window_left", lambda v: f"win{v}"),
            ("num_speculative_tokens", lambda v: f"k{v}"),
            ("capture_sizes", lambda v: "cap" + "_".join(str(x) for x in v)),
            ("max_num_seqs", lambda v: f"seqs{v}"),
        )
        return [label(getattr(self, f)) for f, label in labels if getattr(self, f) != getattr(default, f)]

    @property
    def decode_query_len(self) -> int:
        return 1 + self.num_speculative_tokens

    @property
    def max_batch(self) -> int:
        """vLLM's FA3 builder sizes its buffers for max(max_num_seqs, max_cudagraph_capture_size)."""
        return max(self.max_num_seqs, max(self.capture_sizes))

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.page_size)

    @property
    def window(self) -> tuple[int, int]:
        return (self.window_left, 0 if self.window_left >= 0 else -1)

    @property
    def is_local(self) -> bool:
        return self.window_left >= 0

    def with_(self, **kw: object) -> AttnConfig:
        return replace(self, **kw)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["capture_sizes"] = list(self.capture_sizes)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> AttnConfig:
        d = dict(d)
        if "capture_sizes" in d:
            d["capture_sizes"] = tuple(int(x) for x in d["capture_sizes"])
        return cls(**d)


@dataclass(frozen=True, order=True)
class BatchDescriptor:
    """vLLM's BatchExecutionDescriptor for a FULL uniform-decode graph."""

    num_tokens: int
    num_reqs: int
    uniform_token_count: int = field(default=1, compare=False)
    lens: tuple[int, ...] = field(default=(), compare=False)  # non-uniform query lengths (prompt prefill)

    def __post_init__(self) -> None:
        if self.num_reqs <= 0 or self.num_tokens < self.num_reqs:
            raise ConfigError(f"bad descriptor: {self.num_tokens} tokens for {self.num_reqs} requests")
        if self.lens and (len(self.lens) != self.num_reqs or sum(self.lens) != self.num_tokens):
            raise ConfigError(
                f"query lengths {self.lens} do not make {self.num_tokens} tokens in {self.num_reqs} requests"
            )

    @classmethod
    def varlen(cls, lens: list[int]) -> BatchDescriptor:
        return cls(sum(lens), len(lens), 0, tuple(lens))

    @property
    def label(self) -> str:
        return f"t{self.num_tokens}r{self.num_reqs}"

    def query_lens(self) -> list[int]:
        """make_dummy: every request gets num_tokens // num_reqs, the last also the remainder."""
        if self.lens:
            return list(self.lens)
        base = self.num_tokens // self.num_reqs
        lens = [base] * self.num_reqs
        lens[-1] += self.num_tokens % self.num_reqs
        return lens

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens())


def full_decode_descriptors(cfg: AttnConfig) -> list[BatchDescriptor]:
    """FULL uniform-decode descriptors, largest num_tokens first (the order CudaGraphManager.capture uses).

    num_reqs = round_up(n, q) / q with q = 1 + num_speculative_tokens; tokens are padded to num_reqs * q."""
    q = cfg.decode_query_len
    seen: dict[int, BatchDescriptor] = {}
    for n in sorted(cfg.capture_sizes, reverse=True):
        num_reqs = round_up(n, q) // q  # <= n <= max_batch: always fits vLLM's buffers
        d = BatchDescriptor(num_tokens=num_reqs * q, num_reqs=num_reqs, uniform_token_count=q)
        seen.setdefault(d.num_tokens, d)
    return sorted(seen.values(), reverse=True)


def descriptor_from_label(label: str, q: int) -> BatchDescriptor:
    """Parse `t<tokens>r<reqs>` (or a bare request count) into a descriptor."""
    try:
        if label.startswith("t") and "r" in label:
            t, r = label[1:].split("r")
            return BatchDescriptor(int(t), int(r), q)
        r = int(label)
        return BatchDescriptor(r * q, r, q)
    except ValueError as e:
        raise ConfigError(f"bad descriptor {label!r}: use t<tokens>r<reqs> or a request count") from e
