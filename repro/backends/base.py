"""The small interface every FA3 backend implements, and schema-driven calls into torch ops."""

from __future__ import annotations

import functools
import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from repro.errors import BackendUnavailable

# Values for arguments of FA3's ops that carry no default in some builds' schemas.
_FALLBACKS: dict[str, Any] = {
    "cp_world_size": 1,
    "cp_rank": 0,
    "is_rotary_interleaved": True,
    "softcap": 0.0,
    "attention_chunk": 0,
    "max_seqlen_k_new": 0,
    "has_softcap": False,
}


@dataclass(frozen=True)
class BackendIdentity:
    name: str  # "upstream" or "vllm"
    package: str  # where the kernels came from
    version: str
    library: str  # file name of the loaded extension
    sha256: str  # first 16 hex digits of the extension's hash

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def short(self) -> str:
        return f"{self.name} {self.package} {self.version} ({self.library} {self.sha256})"


def file_sha256(path: str | Path) -> str:
    """First 16 hex digits of a file's SHA-256, hashed once per process for an unchanged file (a forkserver that
    hashed the FA3 libraries before forking spares every case the read of a few hundred MB)."""
    st = Path(path).stat()
    return _sha256(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=16)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def call_op(op: Any, **known: Any) -> Any:
    """Call a torch op overload packet by its schema's argument names.

    Arguments we do not know get the schema default, None when optional, or a fallback; anything else is a
    build we do not understand, reported rather than guessed."""
    schema = op.default._schema
    kwargs: dict[str, Any] = {}
    for arg in schema.arguments:
        if arg.name in known:
            kwargs[arg.name] = known[arg.name]
        elif arg.has_default_value():
            continue
        elif str(arg.type).startswith("Optional") or str(arg.type).endswith("?"):
            kwargs[arg.name] = None
        elif arg.name in _FALLBACKS:
            kwargs[arg.name] = _FALLBACKS[arg.name]
        else:
            raise BackendUnavailable(f"{schema.name}: argument {arg.name!r} ({arg.type}) is not understood")
    return op.default(**kwargs)


class Fa3Backend(Protocol):
    """What a case needs from an FA3 build: AOT scheduler metadata and the forward, both with sm_margin."""

    name: str
    flavor: str  # layout flavor: repro.backends.layout.UPSTREAM or VLLM

    def identity(self) -> BackendIdentity: ...

    def scheduler_metadata(
        self,
        *,
        batch_size: int,
        max_seqlen_q: int,
        max_seqlen_k: int,
        num_heads_q: int,
        num_heads_kv: int,
        head_dim: int,
        cache_seqlens: Any,
        cu_seqlens_q: Any,
        page_size: int,
        causal: bool,
        window: tuple[int, int],
        num_splits: int,
        sm_margin: int,
        dtype: Any,
    ) -> Any: ...

    def forward(
        self,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        *,
        out: Any,
        cu_seqlens_q: Any,
        seqused_k: Any,
        max_seqlen_q: int,
        max_seqlen_k: int,
        block_table: Any,
        causal: bool,
        window: tuple[int, int],
        scheduler_metadata: Any,
        num_splits: int,
        sm_margin: int,
    ) -> Any: ...


class TorchOpsBackend:
    """Shared calls for both builds: their ops use the same argument names."""

    name = "?"
    flavor = "?"
    _ops: Any = None
    _identity: BackendIdentity | None = None

    def identity(self) -> BackendIdentity:
        assert self._identity is not None
        return self._identity

    def scheduler_metadata(
        self,
        *,
        batch_size,
        max_seqlen_q,
        max_seqlen_k,
        num_heads_q,
        num_heads_kv,
        head_dim,
        cache_seqlens,
        cu_seqlens_q,
        page_size,
        causal,
        window,
        num_splits,
        sm_margin,
        dtype,
    ):
        return call_op(
            self._ops.get_scheduler_metadata,
            batch_size=batch_size,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            num_heads=num_heads_q,
            num_heads_k=num_heads_kv,
            headdim=head_dim,
            headdim_v=head_dim,
            qkv_dtype=dtype,
            seqused_k=cache_seqlens,
            cu_seqlens_q=cu_seqlens_q,
            page_size=page_size,
            max_seqlen_k_new=0,
            is_causal=causal,
            window_size_left=window[0],
            window_size_right=window[1],
            attention_chunk=0,
            has_softcap=False,
            num_splits=num_splits,
            pack_gqa=None,
            sm_margin=sm_margin,
        )

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        *,
        out,
        cu_seqlens_q,
        seqused_k,
        max_seqlen_q,
        max_seqlen_k,
        block_table,
        causal,
        window,
        scheduler_metadata,
        num_splits,
        sm_margin,
    ):
        res = call_op(
            self._ops.fwd,
            q=q,
            k=k_cache,
            v=v_cache,
            out=out,
            cu_seqlens_q=cu_seqlens_q,
            seqused_k=seqused_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            page_table=block_table,
            softmax_scale=q.shape[-1] ** -0.5,
            is_causal=causal,
            window_size_left=window[0],
            window_size_right=window[1],
            scheduler_metadata=scheduler_metadata,
            num_splits=num_splits,
            pack_gqa=None,
            sm_margin=sm_margin,
        )
        return res[0]


def same_library(loaded: str | Path | None, wanted: str | Path, what: str) -> None:
    """A process holds one build of a library: a case forked from a server that preloaded another build than the
    one it names must not run the preloaded kernels under the named build's identity. BackendUnavailable says so."""
    if loaded is None or Path(loaded).resolve() == Path(wanted).resolve():
        return
    raise BackendUnavailable(
        f"this process already loaded {what} from {loaded}, not {wanted}: run it in a process of its own "
        "(--executor process), or name that build in the environment the server or forkserver started with"
    )
