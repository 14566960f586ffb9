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


def _kernel_level_params() -> list:
    """Every CPU kernel level; those this CPU cannot execute are skipped (their instructions
    would fault), the rest are built and run, capped builds included."""
    from tandem.engine.kernels.cpu_plan import LEVELS, runnable_levels

    runs = runnable_levels()  # TANDEM_CPU_ISA=avx2 makes an AVX-512 machine test as an AVX2 one
    skip = pytest.mark.skip(reason="this CPU does not execute these instructions")
    return [pytest.param(lv, marks=() if lv in runs else skip) for lv in LEVELS]


@pytest.fixture(params=_kernel_level_params())
def kernel_level(request: pytest.FixtureRequest) -> str:
    """Runs the test with every kernel op on one level's build (cpu_kernels.forced)."""
    from tandem.engine.kernels import cpu_kernels

    with cpu_kernels.forced(request.param):
        assert cpu_kernels.available(), f"{request.param} kernels failed to build: {cpu_kernels.unavailable_reason()}"
        yield request.param


@pytest.fixture
def plan_env(monkeypatch: pytest.MonkeyPatch):
    """plan_env(NAME=value, ...) sets env vars and re-decides the CPU plan under them; the
    env and the plan are back to the process's own after the test."""
    from tandem.engine.kernels import cpu_plan

    def set_env(**env: str) -> None:
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        cpu_plan.reset()

    yield set_env
    cpu_plan.reset()  # before monkeypatch restores the env: the next current() reads the restored one


@pytest.fixture(scope="session")
def model_path():
    """model_path(preset) -> directory of a built-in model, built once and cached."""
    from tandem.engine.modelgen.model_builder import resolve_model

    cache: dict[str, Path] = {}

    def get(preset: str) -> Path:
        if preset not in cache:
            cache[preset] = resolve_model(preset)
        return cache[preset]

    return get
