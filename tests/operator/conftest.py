"""Fixtures for the operator tests; the helpers they use live in operator_support.py."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from typing import Any

import pytest
from operator_support import CHART_DIR, EXAMPLES_DIR, example_paths, load_example


@pytest.fixture(params=example_paths(), ids=lambda p: p.stem)
def example_cr(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_example(request.param)


@pytest.fixture
def minimal_cr() -> dict[str, Any]:
    return load_example(EXAMPLES_DIR / "inferenceservice-minimal.yaml")


@pytest.fixture
def autoscaling_cr() -> dict[str, Any]:
    return load_example(EXAMPLES_DIR / "inferenceservice-autoscaling.yaml")


@pytest.fixture(scope="session")
def kubectl() -> str:
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl is not on PATH (expected at /usr/bin/kubectl on project machines)")
    return path


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    """The Helm chart, loaded once per module (helm-python-sdk; the module skips without it)."""
    helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (operator-test)")
    with helm.Chart.load(str(CHART_DIR)) as loaded:
        yield loaded
