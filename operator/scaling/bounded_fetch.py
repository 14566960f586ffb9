"""GETs the operator makes to addresses a tenant controls: `spec.autoscaling.metricsSource.prometheusUrl`
and every worker pod's /metrics (the pod runs the tenant's image).

A per-read timeout alone lets a server trickle one byte per read for ever, and an unbounded
read lets it send gigabytes; either would stall or kill the operator for every tenant. Here
each fetch streams the body with a running byte count and runs under one overall deadline;
a breach raises FetchError (an httpx.HTTPError, so callers already treat it as "no data").
The request asks for an uncompressed body, and a compressed answer is refused: a decoder
can turn one network chunk of a gzip bomb into a thousand times its size before any count.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import httpx

MAX_BYTES = 4 * 1024 * 1024  # a worker's /metrics is a few KiB; a PromQL vector answer less
DEADLINE_S = 5.0  # connect, headers and the whole body; the timer runs every 15 s by default


@dataclass(frozen=True)
class FetchLimits:
    max_bytes: int = MAX_BYTES
    deadline_s: float = DEADLINE_S


class FetchError(httpx.HTTPError):
    """A fetch over its byte cap, past its deadline, or compressed against our asking."""


async def fetch_text(client: httpx.AsyncClient, url: str, limits: FetchLimits = FetchLimits(),
                     params: dict[str, Any] | None = None) -> str:
    """The body of GET `url` as text (UTF-8, undecodable bytes replaced), within `limits`."""
    try:
        async with asyncio.timeout(limits.deadline_s):
            body = await _read(client, url, limits.max_bytes, params)
    except TimeoutError:
        raise FetchError(f"{url}: no complete answer within {limits.deadline_s:g} s") from None
    return body.decode("utf-8", errors="replace")


async def _read(client: httpx.AsyncClient, url: str, max_bytes: int, params: dict[str, Any] | None) -> bytes:
    headers = {"Accept-Encoding": "identity"}
    async with client.stream("GET", url, params=params, headers=headers) as response:
        response.raise_for_status()
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise FetchError(f"{url}: answered with Content-Encoding {encoding} to Accept-Encoding: identity")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise FetchError(f"{url}: {declared} bytes is over the {max_bytes}-byte cap")
        chunks, total = [], 0
        async for chunk in response.aiter_bytes():  # identity: the bytes as they arrive, nothing decoded
            total += len(chunk)
            if total > max_bytes:
                raise FetchError(f"{url}: the body runs over the {max_bytes}-byte cap")
            chunks.append(chunk)
    return b"".join(chunks)
