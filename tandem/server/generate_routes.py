"""SGLang's native POST /generate, so sgl-router (and SGLang clients) can front our workers.

The body is text or input_ids (one or a batch), SGLang's sampling_params, `stream`,
`return_logprob`/`top_logprobs_num`, `rid`, and the PD bootstrap fields.

A streamed chunk carries only what is new since the previous one (text, ids, logprobs), as
SGLang does with --incremental-streaming-output; its meta_info counts are running totals.
SGLang's default resends everything so far in every chunk, which is quadratic in the
answer's length: a long stream with logprobs would cost the worker's event loop seconds of
JSON per request, an easy way for one client to slow every other.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.protocol.openai_api import GenerateRequest
from tandem.server.choices import Choice, Delta, await_admission, collect, merged, open_choices
from tandem.server.runtime import Runtime
from tandem.server.schema_step import check_schemas
from tandem.web.disconnect import cancel_on_disconnect
from tandem.web.errors import ApiError
from tandem.web.finite_json import FiniteJSONResponse, sse

router = APIRouter()


def _finish_reason(out: Any) -> dict[str, Any] | None:
    if not out.finished:
        return None
    r = out.finish_reason or {}
    kind = r.get("kind", "stop")
    if kind == "length":
        return {"type": "length", "length": out.completion_tokens}
    if kind == "abort":
        return {"type": "abort", "message": r.get("message")}
    return {"type": "stop", "matched": r.get("matched")}


def _meta(c: Choice, deltas: list[Delta], t0: float, logprob: bool) -> dict[str, Any]:
    last = deltas[-1].out
    meta: dict[str, Any] = {
        "id": c.stream.name, "finish_reason": _finish_reason(last), "prompt_tokens": c.prompt_len,
        "completion_tokens": last.completion_tokens, "cached_tokens": last.cached_tokens,
        "e2e_latency": time.monotonic() - t0,
    }
    if logprob:
        ids = [t for d in deltas for t in d.token_ids]
        lps = [x for d in deltas for x in d.out.logprobs or []]
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, ids)]
        meta["output_top_logprobs"] = [[[lp, int(t), None] for t, lp in row]
                                       for d in deltas for row in d.out.top_logprobs or []]
    return meta


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    rt.check_bootstrap(body)
    await check_schemas(body.schemas)
    t0 = time.monotonic()
    sp = body.sampling_params.engine_kwargs()
    if body.return_logprob or body.top_logprobs_num:
        sp["return_logprob"], sp["top_logprobs_num"] = True, body.top_logprobs_num
    jobs = []
    for ids in await rt.tokens.encode_many(body.prompts()):
        rt.tokens.max_new_tokens(len(ids), sp["max_new_tokens"])
        jobs.append((ids, sp))
    choices = open_choices(rt.front, rt.tokens, jobs, rid=body.rid,
                           skip_special_tokens=body.sampling_params.skip_special_tokens, bootstrap=body)
    logprob = bool(body.return_logprob or body.top_logprobs_num)
    if body.stream:
        if body.sampling_params.constraint is not None:  # one that does not compile: a 400, not an error event
            await cancel_on_disconnect(request, await_admission(rt.front, choices))
        return StreamingResponse(_stream(rt, choices[0], t0, logprob), media_type="text/event-stream")
    per = await cancel_on_disconnect(request, collect(rt.front, choices))
    results = [{"text": c.text.text, "output_ids": [t for d in ds for t in d.token_ids],
                "meta_info": _meta(c, ds, t0, logprob)} for c, ds in zip(choices, per)]
    return FiniteJSONResponse(results if body.is_batch else results[0])


async def _stream(rt: Runtime, c: Choice, t0: float, logprob: bool) -> AsyncIterator[str]:
    try:
        async for d in merged(rt.front, [c]):
            chunk = {"text": d.text, "output_ids": d.token_ids, "meta_info": _meta(c, [d], t0, logprob)}
            yield sse(chunk)
    except ApiError as exc:
        yield sse(exc.body())
    yield "data: [DONE]\n\n"
