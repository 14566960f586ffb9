"""Runtime: what every handler reaches through `request.app.state.runtime`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from tandem.server.config import ServerConfig
from tandem.server.errors import ApiError
from tandem.server.front import Front
from tandem.server.metrics import ServerMetrics
from tandem.server.tokens import Tokens

T = TypeVar("T")


@dataclass
class Runtime:
    config: ServerConfig
    front: Front
    tokens: Tokens
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False

    def require_generation(self) -> None:
        if not self.config.generates:
            raise ApiError(501, f"a {self.config.role} worker serves generation once prefill/decode "
                                "disaggregation lands; use --role colocated")


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


