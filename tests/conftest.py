from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# One intra-op thread in every process of the tier (the workers and the case, CLI and pytest processes they start,
# which inherit it): the README's command runs two xdist workers on two cores, each starting processes of its own, and
# torch's OpenMP threads beyond one spin against each other there (test_weights with test_specdecode: 13.7 CPU-s with
# a thread per core, 7.2 with one; the same answers). A value set outside the tests is kept.
if "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:  # imported before this file: its thread pool read the variable already
        sys.modules["torch"].set_num_threads(1)

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES


@pytest.fixture(scope="session", params=["vllm-0.25.1", "upstream"])
def replay(request):
    from repro.backends.replay import ReplayBackend

    return ReplayBackend(FIXTURES / "metadata" / f"h200-{request.param}.jsonl.gz")


@pytest.fixture(autouse=True)
def _private_cache_dir(tmp_path, monkeypatch):
    """Every test (and the processes it starts) keeps the vLLM gate's caches in its own folder, never the user's."""
    monkeypatch.setenv("REPRO_CACHE_DIR", str(tmp_path / "repro-cache"))


# Tests that share one costly module fixture, by node-id prefix: under `pytest -n N` each group runs on one worker,
# so that its fixture runs once instead of once on every worker that drew one of its tests (xdist's `--dist load`
# deals tests out two at a time; its loadgroup marks do not reach the node ids under pytest 9).
SHARED_FIXTURE = (
    "tests/test_vllm_gate.py::test_builds_that_hook_nothing_cannot_be_vouched_for_through_the_cli",  # a gate CLI run
    "tests/test_gpu_tier_under_xdist.py::",  # three pytest sessions of the GPU tier
    "tests/test_weights.py::",  # the gate model's weights
    "tests/test_weights_dflash.py::",  # the target's and the DFlash draft's weights
    "tests/test_cli_without_gpu.py::",  # the CPU model's matrix run (two of its tests)
)


def pytest_collection_modifyitems(config, items):
    """This folder's tests marked slow (the tier's longest, over a minute of CPU on a loaded 2-core machine) first, the rest in
    their order (a stable sort): under `pytest -n N` xdist deals them out after the SHARED_FIXTURE groups, so that
    they run beside the many short tests instead of one of them starting late and running alone at the end."""
    items.sort(key=lambda item: not (item.get_closest_marker("slow") and Path(__file__).parent in item.path.parents))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's load scheduling, each SHARED_FIXTURE group one unit of work (scheduled first: the longest), every
    other test a unit of its own. Any other --dist mode: xdist's own scheduler."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling  # xdist only in the session that distributes tests

    class SharedFixtureScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return next((p for p in SHARED_FIXTURE if nodeid.startswith(p)), nodeid)

    return SharedFixtureScheduling(config, log)
