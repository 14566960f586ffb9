"""Shared fixtures: built-in test models, runners, and the pool integrity check."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Two cores: oversubscribed OpenMP threads spin and stall, so tests stay at the core count.
os.environ.setdefault("OMP_NUM_THREADS", "2")

ARCH_PRESETS = {"qwen3": "tiny", "llama": "tiny-llama", "qwen2": "tiny-qwen2"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def model_path():
    """model_path(preset) -> directory of a built-in model, built once and cached."""
    from tandem.engine.model_builder import resolve_model

    cache: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in cache:
            cache[preset] = resolve_model(preset)
        return cache[preset]

    return get
