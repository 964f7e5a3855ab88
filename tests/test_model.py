"""The CPU model of FA3: bit for bit against every buffer recorded on the H200, reads and predicted verdicts."""

import time

import pytest

from repro.backends.layout import UPSTREAM, VLLM, metadata_layout
from repro.backends.replay import load_records
from repro.backends.scheduler_inputs import SchedulerInputs
from repro.case.descriptors import AttnConfig
from repro.fa3_model.predict import predict_case, predict_matrix
from repro.fa3_model.reads import combine_max_splits, predict_launch
from repro.fa3_model.scheduler import PAD, num_splits_heuristic, scheduler_metadata
from tests.records import RESULTS


def _inputs(header, r):
    return SchedulerInputs.from_record(header, r)


def first_difference(model, gpu, layout):
    """'field[index]: model X, gpu Y' for the first written entry that differs, else None."""
    if len(model) != len(gpu):
        return f"size: model {len(model)}, gpu {len(gpu)} ({layout.describe()})"
    for i, (m, g) in enumerate(zip(model, gpu)):
        if m is not PAD and m != g:
            if i == layout.semaphore_offset:
                return f"semaphore: model {m}, gpu {g}"
            vec, idx = divmod(i, layout.batch_rounded)
            return f"{layout.vectors[vec]}[{idx}]: model {m}, gpu {g}"
    return None


@pytest.mark.parametrize("name", ["vllm-0.25.1", "upstream"])
def test_model_reproduces_every_recorded_buffer_bit_for_bit(fixtures, name):
    header, records = load_records(fixtures / "metadata" / f"h200-{name}.jsonl.gz")
    assert len(records) >= 600
    compared = 0
    for n, r in enumerate(records):
        buf, plan = scheduler_metadata(_inputs(header, r))
        diff = first_difference(buf, r["metadata"], plan.layout)
        assert diff is None, (
            f"record {n} ({r['batch']} reqs, splits {r['num_splits']}, margin {r['sm_margin']}): {diff}"
        )
        compared += sum(v is not PAD for v in buf)
    assert compared > 50_000


def test_first_difference_names_the_field():
    lay = metadata_layout(VLLM, 2, 32, True, False)
    model = [8, 8, PAD, PAD, 1, 2, PAD, PAD, 4, 4, PAD, PAD, 0]
    gpu = [8, 8, 7, 7, 1, 1, 7, 7, 4, 4, 7, 7, 0]
    assert first_difference(model, gpu, lay) == "num_splits_dynamic[1]: model 2, gpu 1"


def test_split_heuristic_shrinks_with_sms():
    # decode, 8 kv heads, one m-block, 256 n-blocks of a 4096-token cache
    assert num_splits_heuristic(8, 132, 32, 1, 4096 * 256 * 2, True, 128) > num_splits_heuristic(
        8, 16, 32, 1, 4096 * 256 * 2, True, 128
    )
    assert num_splits_heuristic(200, 132, 32, 1, 1, True, 128) == 1  # enough m-blocks: no split
    assert num_splits_heuristic(1, 132, 4, 1, 1, True, 128) == 1  # too few n-blocks


def test_combine_max_splits():
    assert combine_max_splits(2, 128) == 32 and combine_max_splits(33, 128) == 64
    assert combine_max_splits(2, 64) == 16


def test_predict_combine_overread_bytes():
    lay = metadata_layout(UPSTREAM, 2, 2, True, False)
    # num_splits_dynamic [8, 1] | m_blocks | batch idx | heads | semaphore
    view = [8, 1, 0, 0, 1, 1, 0, 0, 0, 1, 0, 0, 8, 8, 0, 0, 0]
    p = predict_launch(view, lay, 2, 32, 128, 8, [0, 4, 8], stale_entries=3)
    assert (p.verdict, p.kernel, p.buffer) == ("oob", "combine", "lse_accum")
    assert p.alloc_bytes == 2 * 32 * 8 * 4 and p.byte_range == (2048, 8 * 32 * 8 * 4)
    hidden = predict_launch(view, lay, 2, 32, 128, 8, [0, 4, 8], 3, sanitizer=False)
    assert hidden.verdict == "wrong-output" and "caching allocator" in hidden.reason


def test_predict_flags_and_clean():
    lay = metadata_layout(VLLM, 2, 32, True, False)
    clean = [16, 16, 0, 0, 1, 1, 0, 0, 8, 8, 0, 0, 0]
    assert predict_launch(clean, lay, 32, 32, 128, 8, [0, 4, 8], 0).verdict == "clean"
    bad = [16, 2**31 - 1, 0, 0, 1, 1, 0, 0, 0, 8, 0, 0, 3]
    p = predict_launch(bad, lay, 32, 32, 128, 8, [0, 4, 8], 5)
    assert (p.verdict, p.kernel) == ("oob", "main")
    assert any("semaphore 3" in f for f in p.flags) and any("num_nheads_in_l2 has zeros" in f for f in p.flags)


def test_predictions_of_the_default_matrix():
    cfg = AttnConfig()
    # unpoisoned: the combine over-read at 16 SMs with FA3's heuristic, silent garbage at 132 or with 32 splits
    p, d = predict_case(UPSTREAM, "stale", 16, cfg.with_(num_splits=0), None)
    assert (p.verdict, p.kernel, d, p.alloc_bytes) == ("oob", "combine", "t64r16", 16384)
    assert predict_case(UPSTREAM, "stale", 132, cfg.with_(num_splits=0), None)[0].verdict == "wrong-output"
    assert predict_case(VLLM, "stale", 16, cfg.with_(num_splits=32), None)[0].verdict == "wrong-output"
    p, d = predict_case(VLLM, "stale", 16, cfg.with_(num_splits=0), None)
    assert (p.verdict, d) == ("oob", "t32r8")
    for flavor in (UPSTREAM, VLLM):
        for sms in (16, 132):
            assert predict_case(flavor, "fresh", sms, cfg, "int-max")[0].verdict == "clean"


def test_model_matrix_benchmark_under_10_s():
    t0 = time.perf_counter()
    cases, seconds = predict_matrix(poison="int-max")
    assert len(cases) == 40 and time.perf_counter() - t0 < 10


def test_agreement_with_recorded_gpu_runs():
    from repro.report.agreement import compare

    rows = compare(
        [RESULTS / "h200-memcheck-benchmark" / "results.json", RESULTS / "h200-memcheck-nopoison" / "results.json"]
    )
    assert len(rows) >= 30
    assert all(r.verdict_agrees for r in rows)


def test_agreement_with_memcheck_that_destroys_the_faulting_context():
    """results/h200-memcheck-warm (memcheck with --destroy-on-device-error context, stopped at the first whole error):
    the verdicts and the kernel memcheck named first still agree with the model, on both execution paths."""

    from repro.report.agreement import compare

    root = RESULTS / "h200-memcheck-warm"
    rows = compare([root / "old" / "results.json", root / "new" / "results.json"])
    assert len(rows) == 48 and all(r.verdict_agrees for r in rows)  # the eager cases the model covers, both paths
    named = [r for r in rows if r.kernel_agrees is not None]
    assert len(named) == 24 and all(r.kernel_agrees for r in named)


def test_the_cpu_model_does_not_import_the_gpu_runner():
    import subprocess
    import sys

    code = (
        "import sys, repro.report.agreement, repro.fa3_model.predict, repro.report.results\n"
        "print(sorted(m for m in ('repro.run.runner', 'repro.attention.worker', 'repro.backends.upstream') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.stdout.strip() == "[]", r.stderr


def test_unknown_padding_gives_the_outcomes_the_model_cannot_rule_out():
    from repro.backends.layout import UPSTREAM, VLLM
    from repro.fa3_model.predict import predict_outcomes

    cfg = AttnConfig(num_splits=32)
    assert predict_outcomes(VLLM, "stale", 16, cfg, "int-max") == ("oob",)  # known padding: one verdict
    unknown = predict_outcomes(UPSTREAM, "stale", 16, cfg, None)
    assert len(unknown) > 1 and "wrong-output" in unknown  # zero padding alone would have claimed one
    assert predict_outcomes(VLLM, "fresh", 16, cfg, None) == ("clean",)  # fresh metadata reads no padding
