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
