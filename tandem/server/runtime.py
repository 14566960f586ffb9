"""Runtime: what every handler reaches through `request.app.state.runtime`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from tandem.server.config import ServerConfig
from tandem.server.errors import ApiError
from tandem.server.front import Front
from tandem.server.metrics import ServerMetrics
from tandem.server.tokens import Tokens
from tandem.worker_contract import PREFILL

T = TypeVar("T")


@dataclass
class Runtime:
    config: ServerConfig
    front: Front
    tokens: Tokens
    metrics: ServerMetrics
    started: int = field(default_factory=lambda: int(time.time()))
    ready: bool = False

    def check_bootstrap(self, body: Any) -> dict[str, Any]:
        """The request's PD fields; a prefill worker serves only disaggregated requests."""
        if self.config.role == PREFILL and body.bootstrap_room is None:
            raise ApiError(400, "a prefill worker serves only disaggregated requests: send it through a PD "
                                "router (bootstrap_room is missing)", param="bootstrap_room")
        return body.bootstrap()


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


