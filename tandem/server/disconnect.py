"""Cancel a non-streaming answer's work when its client goes away (Starlette watches for
disconnects only while streaming). Torch-free: the worker's routes and the router's use it."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

from tandem.server.errors import ApiError

T = TypeVar("T")


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it if the client disconnects first (non-streaming
    responses: Starlette only watches for disconnects while streaming)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.create_task(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        raise ApiError(400, "the client disconnected")  # nobody reads this; it ends the handler
    return task.result()


