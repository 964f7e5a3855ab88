"""Record real FA3 scheduler metadata on the GPU as compact fixtures (gzip JSON lines).

`python -m repro.fa3_model.record OUT.jsonl.gz --backend vllm --random 500 --default-matrix`
Each line: the get_scheduler_metadata inputs, the returned int32 buffer and its decoded layout. The CPU tier
replays these (repro.backends.replay) so builder, layout and stale-diff tests run on what FA3 really returns."""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys

from repro.backends import load_backend
from repro.backends.layout import effective_causal, layout_from_size
from repro.case.descriptors import AttnConfig, full_decode_descriptors

SHAPES = [(32, 8, 128), (32, 32, 128), (16, 2, 64), (64, 8, 128), (8, 1, 256), (28, 4, 128), (40, 8, 96)]


def record_call(
    backend,
    dev,
    *,
    batch,
    query_lens,
    seq_lens,
    max_seqlen_k,
    hq,
    hkv,
    d,
    page,
    causal,
    window_left,
    num_splits,
    sm_margin,
) -> dict:
    import torch  # torch only when recording: --help needs none

    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    cu = torch.tensor(qsl, dtype=torch.int32, device=dev)
    sl = torch.tensor(seq_lens, dtype=torch.int32, device=dev)
    window = (window_left, 0) if window_left >= 0 else (-1, -1)
    md = backend.scheduler_metadata(
        batch_size=batch,
        max_seqlen_q=max(query_lens),
        max_seqlen_k=max_seqlen_k,
        num_heads_q=hq,
        num_heads_kv=hkv,
        head_dim=d,
        cache_seqlens=sl,
        cu_seqlens_q=cu,
        page_size=page,
        causal=causal,
        window=window,
        num_splits=num_splits,
        sm_margin=sm_margin,
        dtype=torch.bfloat16,
    )
    torch.cuda.synchronize()
    is_causal, is_local = effective_causal(causal, window_left, max(query_lens), max_seqlen_k, d, True)
    lay = layout_from_size(backend.flavor, batch, md.numel(), is_causal, is_local)
    return {
        "flavor": backend.flavor,
        "batch": batch,
        "query_start_loc": qsl,
        "seq_lens": list(seq_lens),
        "max_seqlen_q": max(query_lens),
        "max_seqlen_k": max_seqlen_k,
        "num_heads_q": hq,
        "num_heads_kv": hkv,
        "head_dim": d,
        "page_size": page,
        "causal": causal,
        "window_left": window_left,
        "num_splits": num_splits,
        "sm_margin": sm_margin,
        "metadata": md.tolist(),
        "vectors": list(lay.vectors),
    }


def default_matrix_calls(cfg: AttnConfig, margins: list[int]) -> list[dict]:
    """The calls the default matrix's builders make (make_dummy batches), for the replay backend."""
    calls = []
    for splits in (32, 0):
        c = cfg.with_(num_splits=splits)
        for desc in full_decode_descriptors(c):
            for m in margins:
                calls.append(
                    dict(
                        batch=desc.num_reqs,
                        query_lens=desc.query_lens(),
                        seq_lens=desc.query_lens(),
                        max_seqlen_k=c.max_model_len,
                        hq=c.num_heads_q,
                        hkv=c.num_heads_kv,
                        d=c.head_dim,
                        page=c.page_size,
                        causal=c.causal,
                        window_left=c.window_left,
                        num_splits=splits,
                        sm_margin=m,
                    )
                )
    return calls


def random_calls(n: int, seed: int, margins: list[int]) -> list[dict]:
    rng = random.Random(seed)
    calls = []
    for _ in range(n):
        hq, hkv, d = rng.choice(SHAPES)
        b = rng.choice([1, 2, 3, 4, 5, 7, 8, 13, 16, 31, 32, 33, 48, 64, 100, 128])
        ql = rng.choice([1, 2, 4, 8])
        qlens = [ql if rng.random() < 0.8 else rng.randint(1, 16) for _ in range(b)]
        maxk = rng.choice([512, 2048, 4096, 16384])
        slens = [rng.choice([q for q in (rng.randint(1, maxk), qlens[i], maxk)]) for i, q in enumerate(qlens)]
        slens = [max(s, qlens[i]) for i, s in enumerate(slens)]
        calls.append(
            dict(
                batch=b,
                query_lens=qlens,
                seq_lens=slens,
                max_seqlen_k=maxk,
                hq=hq,
                hkv=hkv,
                d=d,
                page=rng.choice([16, 64]),
                causal=rng.random() < 0.7,
                window_left=rng.choice([-1, -1, -1, 128]),
                num_splits=rng.choice([0, 32]),
                sm_margin=rng.choice(margins),
            )
        )
    return calls


def main(argv: list[str] | None = None) -> int:
    import torch  # as above

    p = argparse.ArgumentParser(prog="python -m repro.fa3_model.record")
    p.add_argument("out")
    p.add_argument("--backend", required=True)
    p.add_argument("--random", type=int, default=0, help="randomized descriptors to record")
    p.add_argument("--default-matrix", action="store_true", help="record the default matrix's builder calls")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    be = load_backend(a.backend)
    dev = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    margins = sorted({0, total - 16, total - 26, total - 32, total - 60})
    calls = (default_matrix_calls(AttnConfig(), [0, total - 16]) if a.default_matrix else []) + random_calls(
        a.random, a.seed, margins
    )
    with gzip.open(a.out, "wt") as f:
        f.write(
            json.dumps(
                {
                    "header": True,
                    "backend": be.identity().to_dict(),
                    "sms": total,
                    "gpu": torch.cuda.get_device_name(0),
                    "torch": torch.__version__,
                }
            )
            + "\n"
        )
        for c in calls:
            f.write(json.dumps(record_call(be, dev, **c)) + "\n")
    print(f"recorded {len(calls)} calls to {a.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
