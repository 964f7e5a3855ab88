"""Case identity: every parameter that changes what runs is in the case id (the id names the case's log files, so
two cases with one id overwrote each other's logs on the H200: 24 fresh spec-decode cases read "no result line")."""

from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys
from pathlib import Path

import pytest

from repro.case import sets as case_sets
from repro.case.descriptors import AttnConfig
from repro.case.matrix import MatrixOptions, build_specs
from repro.case.spec import CaseSpec, SmConfig
from repro.errors import ConfigError
from repro.run.pytest_cases import RUN_ENV, start_run_logs
from tests.commands import main_in
from tests.records import RESULTS

ROOT = Path(__file__).resolve().parent.parent


def test_every_gpu_case_has_an_id_of_its_own():
    full = case_sets.spec_decode({"REPRO_SPEC_SWEEP": "full"})  # the whole cross product too
    for specs in ([s for group in case_sets.all_gpu_cases().values() for s in group], full):
        ids = [s.case_id for s in specs]
        dups = sorted({i for i in ids if ids.count(i) > 1})
        assert not dups, dups[:3]
    assert len(full) == 192


def test_pytest_collects_the_case_sets_with_unique_ids():
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "gpu", "cases"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln]
    assert r.returncode == 0 and len(ids) == len(set(ids))
    n = sum(len(g) for g in case_sets.all_gpu_cases().values())
    assert len([i for i in ids if "vllm_gate" not in i]) == n


def test_each_config_field_changes_the_id():
    base = CaseSpec("upstream", "stale", scenario="spec-decode")
    other = {"page_size": 64, "max_model_len": 2048, "causal": False, "window_left": 128,
             "num_speculative_tokens": 1, "capture_sizes": (4, 8, 16), "max_num_seqs": 16,
             "num_heads_q": 16, "num_heads_kv": 16, "head_dim": 64, "num_splits": 0}  # fmt: skip
    fields = {f.name for f in dataclasses.fields(AttnConfig)}
    assert set(other) == fields, "a new AttnConfig field needs a case-id part (AttnConfig.id_parts)"
    ids = {base.case_id}
    for name, value in other.items():
        ids.add(dataclasses.replace(base, cfg=base.cfg.with_(**{name: value})).case_id)
    for change in ({"pair": ("t4r1", "t32r8")}, {"seed": 1}, {"backend_path": "/a"}, {"sanitizer": True}):
        ids.add(dataclasses.replace(base, **change).case_id)
    assert len(ids) == 1 + len(other) + 4
    assert dataclasses.replace(base, backend_path="/a").case_id != dataclasses.replace(base, backend_path="/b").case_id


def test_default_matrix_keeps_its_recorded_ids():
    """Ids of default configurations are unchanged, so records stay comparable (results/h200-default-served)."""
    import json

    recorded = {c["case"] for c in json.loads((RESULTS / "h200-default-served" / "results.json").read_text())["cases"]}
    assert {s.case_id for s in build_specs(MatrixOptions())} == recorded


def test_spec_decode_rows_cover_every_pair_of_axis_values():
    axes = list(case_sets.SPEC_DECODE_AXES.values())
    rows = case_sets.PAIRWISE
    for i, j in itertools.combinations(range(len(axes)), 2):
        assert {(r[i], r[j]) for r in rows} == set(itertools.product(axes[i], axes[j])), (i, j)


@pytest.mark.parametrize("axis,value", [("strategies", ("stale", "stale")), ("sms", ("full", "full")),
                                        ("splits", (0, 0)), ("modes", ("eager", "eager"))])  # fmt: skip
def test_duplicate_axis_values_are_refused(axis, value):
    with pytest.raises(ConfigError, match="given twice"):
        build_specs(dataclasses.replace(MatrixOptions(), **{axis: value}))


def test_same_case_under_two_names_is_refused():
    """sm_margin:132 and full differ in name only on an H200; the matrix would give them one id if labels collided."""
    specs = build_specs(MatrixOptions(sms=("sm_margin:16", "full")))
    assert len({s.case_id for s in specs}) == len(specs)
    assert SmConfig.parse("sm_margin:16").label != SmConfig.parse("mps:16").label


def test_cli_refuses_duplicate_axis_values(tmp_path):
    r = main_in(["matrix", "--strategies", "stale,stale"], tmp_path)
    assert r.returncode == 2 and "given twice" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_each_run_and_worker_logs_to_a_folder_of_its_own(tmp_path):
    env = {"REPRO_LOG_DIR": str(tmp_path)}
    gw0 = start_run_logs("gw0", env)
    gw1 = start_run_logs("gw1", env)  # a worker started after the controller named the run
    assert gw0.parent == gw1.parent and gw0 != gw1 and env[RUN_ENV] == str(gw0.parent)
    other = start_run_logs("gw0", {"REPRO_LOG_DIR": str(tmp_path)})
    assert other.parent != gw0.parent or other.parent.name.endswith(str(__import__("os").getpid()))


def test_poison_none_and_no_poison_mean_the_same_case(tmp_path):
    a = main_in(["matrix", "--dry-run", "--poison", "none"], tmp_path).stdout.split()
    b = main_in(["matrix", "--dry-run", "--poison", "0"], tmp_path).stdout.split()
    assert a and all("poison" not in x for x in a) and all(x.endswith("poison-0") for x in b)
