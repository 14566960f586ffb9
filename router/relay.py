"""A stream's relay: the worker's SSE bytes to the client as they come, with its metrics.

Past the first byte nothing is retried: a worker that dies mid-stream gives the client an SSE
error event and [DONE]. However the stream ends (its last byte, the worker gone, the client
gone), `finish` runs once and the worker connection is closed, which the worker takes as its
client leaving: it aborts the request and frees its pages. A client that stops reading is cut
off by the HTTP protocol's stall timeout (--stream-send-timeout, tandem/web/coalesced_http.py),
which ends the relay the same way.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable

from tandem.router.metrics import RouterMetrics
from tandem.router.reported import output_tokens, prompt_tokens
from tandem.router.upstream import UpstreamError, UpstreamResponse
from tandem.router.workers import Worker
from tandem.web.errors import error_body


async def relay(metrics: RouterMetrics, resp: UpstreamResponse, worker: Worker, t0: float, count_prompt: bool,
                finish: Callable[[], None]) -> AsyncIterator[bytes]:
    """`count_prompt`: the prompt was not tokenized here, so its tokens are the worker's count."""
    last, events, usage, prompt = None, 0, None, None
    try:
        async for chunk in resp.iter_any():
            now = time.monotonic()
            (metrics.ttft if last is None else metrics.itl).observe(now - (last or t0))
            last = now
            events += chunk.count(b"data: {")
            if b"completion_tokens" in chunk:  # the usage chunk, last before [DONE]
                usage = output_tokens(chunk, usage, last=True)
            if count_prompt and prompt is None:
                prompt = prompt_tokens(chunk, None, last=True)
            yield chunk
    except (UpstreamError, TimeoutError) as exc:  # the worker died mid-stream: too late to retry
        worker.breaker.on_fault()
        err = error_body(503, f"worker {worker.url} failed mid-stream ({type(exc).__name__}); "
                              "the answer is incomplete", code="worker_failed")
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
    finally:
        metrics.latency.observe(time.monotonic() - t0)
        metrics.generation_tokens.inc(usage if usage is not None else events)
        if prompt is not None:
            metrics.prompt_tokens.inc(prompt)
        resp.close()  # a stream cut short (client gone) closes the connection: the worker aborts
        finish()
