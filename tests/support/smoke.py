"""Which form of the `slow` tests runs. By default (what CI and the README's command run) each
takes its bounded smoke form; `pytest --full` (or TANDEM_TEST_FULL=1) runs them whole.

Read at import, so module-level sizes (hypothesis settings, request counts) can use it:
tests/conftest.py sets the variable from --full before any test module is collected."""

from __future__ import annotations

import os

ENV = "TANDEM_TEST_FULL"


def full() -> bool:
    return os.environ.get(ENV) == "1"


def sized(smoke: int, whole: int) -> int:
    """`whole` under --full, `smoke` otherwise."""
    return whole if full() else smoke


def full_only(covered_by: str):  # -> pytest.MarkDecorator
    """A case CI leaves to --full: a sibling case of the smoke form runs the same code path
    (`covered_by` names it), so only the extra combination waits for the whole run."""
    import pytest

    return pytest.mark.skipif(not full(), reason=f"--full only; the smoke form covers it: {covered_by}")
