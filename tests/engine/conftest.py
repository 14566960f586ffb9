"""The engine tests' fixture: `engine(**config)` builds offline Engines and checks them after."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_checks import assert_whole

from tandem import Engine


@pytest.fixture
def engine(model_path: Callable[[str], Path]) -> Iterator[Callable[..., Engine]]:
    """engine(model="tiny", **config) -> an offline Engine, float32 unless `dtype` says
    otherwise; `model` is a built-in preset or a model directory.

    Teardown checks every engine the test left running (its scheduler never stopped, its
    pools are whole: assert_whole) and shuts them all down, also when a check fails. An
    engine the test shut down itself (one whose scheduler it broke on purpose) is not checked."""
    built: list[Engine] = []

    def make(model: str | Path = "tiny", **config: Any) -> Engine:
        path = model_path(model) if isinstance(model, str) else model
        eng = Engine(str(path), **{"dtype": "float32", **config})
        built.append(eng)
        return eng

    yield make
    try:
        for eng in built:
            if not eng.closed:
                assert_whole(eng)
    finally:
        for eng in built:
            eng.shutdown()
