from __future__ import annotations

from pathlib import Path

import pytest

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
