"""Server tests: real `tandem serve` processes (tests/support/worker_process.py)."""

from __future__ import annotations

import pytest
from worker_process import Worker  # noqa: E402

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def worker(model_path):
    """One colocated worker on the tiny model, shared by a module's tests."""
    with Worker.colocated(model_path("tiny"), "--max-total-tokens", "16384") as w:
        yield w
        assert w.pool()["whole"], w.output()


@pytest.fixture(scope="module")
def client(worker):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=worker.url + "/v1", api_key="none", max_retries=0, timeout=120)
