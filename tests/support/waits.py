"""Waiting on state, not on time: a test that sleeps "long enough" fails on a loaded machine
and wastes time on an idle one; these poll a condition until it holds or a deadline passes."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(cond: Callable[[], T], timeout: float, what: str, interval: float = 0.02) -> T:
    """Poll `cond` until it returns something truthy, and return that; fail naming `what`
    once `timeout` s pass."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


async def async_wait_until(cond: Callable[[], T | Awaitable[T]], timeout: float, what: str,
                           interval: float = 0.001) -> T:
    """wait_until on an event loop: each poll yields to the loop, so its callbacks run. `cond`
    may be a coroutine function, for a condition that needs a request to check."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        await asyncio.sleep(interval)
