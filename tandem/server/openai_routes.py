"""OpenAI's /v1/completions and /v1/models (chat is chat_routes.py), and what both share.

Choice i of prompt p has index p * n + i, as OpenAI numbers them. Streams are SSE
(`data: {json}` per chunk, `data: [DONE]` last); with stream_options.include_usage
every chunk carries "usage": null and one last chunk with no choices carries it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.protocol.openai_api import CompletionRequest
from tandem.server.choices import Choice, Delta, await_admission, check_model, collect, merged, open_choices
from tandem.server.runtime import Runtime
from tandem.server.schema_step import check_schemas
from tandem.server.tokens import Tokens
from tandem.web.disconnect import cancel_on_disconnect
from tandem.web.errors import ApiError
from tandem.web.finite_json import FiniteJSONResponse, sse

router = APIRouter()


def usage(choices: list[Choice], outs: list[Any], per_prompt: int) -> dict[str, Any]:
    prompt = sum(c.prompt_len for c in choices[::per_prompt])
    completion = sum(o.completion_tokens for o in outs)
    cached = sum(o.cached_tokens for o in outs[::per_prompt])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ---- logprobs in each API's shape ---------------------------------------------------------------
def completion_logprobs(tokens: Tokens, d: Delta, offset: int) -> dict[str, Any]:
    strs = [tokens.token_text(t) for t in d.token_ids]
    offsets, pos = [], offset
    for s in strs:
        offsets.append(pos)
        pos += len(s)
    tops = [{tokens.token_text(int(t)): lp for t, lp in row} for row in d.out.top_logprobs or []]
    return {"tokens": strs, "token_logprobs": list(d.out.logprobs or []),
            "top_logprobs": tops or [None] * len(strs), "text_offset": offsets}


# ---- /v1/completions ------------------------------------------------------------------------------------
@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    rt.check_bootstrap(body)
    check_model(body.model, rt.config.served_model_name)
    await check_schemas(body.schemas)
    jobs, echoes = [], []
    prompts = body.prompts()
    for prompt, ids in zip(prompts, await rt.tokens.encode_many(prompts)):
        budget = rt.tokens.max_new_tokens(len(ids), body.max_tokens)
        echo = (prompt if isinstance(prompt, str) else rt.tokens.decode(ids)) if body.echo else ""
        for i in range(body.n):
            jobs.append((ids, body.sampling(budget, i, body.logprobs, rt.default_seed)))
            echoes.append(echo)
    choices = open_choices(rt.front, rt.tokens, jobs, skip_special_tokens=body.skip_special_tokens, bootstrap=body)
    head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": rt.config.served_model_name}
    if body.stream:
        if body.constraint_sources:  # a constraint that does not compile is a 400, not an error event
            await cancel_on_disconnect(request, await_admission(rt.front, choices))
        return StreamingResponse(_stream_completions(rt, body, choices, head, echoes),
                                 media_type="text/event-stream")
    per = await cancel_on_disconnect(request, collect(rt.front, choices))
    out_choices = []
    for c, deltas, echo in zip(choices, per, echoes):
        lp = None
        if body.logprobs is not None:
            parts = [completion_logprobs(rt.tokens, d, 0) for d in deltas]
            lp = {k: [x for p in parts for x in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs")}
            lp["text_offset"] = _offsets(lp["tokens"])
        out_choices.append({"index": c.index, "text": echo + c.text.text, "logprobs": lp,
                            "finish_reason": deltas[-1].finish_reason})
    return FiniteJSONResponse({**head, "choices": out_choices,
                               "usage": usage(choices, [d[-1].out for d in per], body.n)})


def _offsets(strs: list[str]) -> list[int]:
    out, pos = [], 0
    for s in strs:
        out.append(pos)
        pos += len(s)
    return out


async def _stream_completions(rt: Runtime, body: CompletionRequest, choices: list[Choice], head: dict,
                              echoes: list[str]) -> AsyncIterator[str]:
    extra = {"usage": None} if body.include_usage else {}
    finals: dict[int, Any] = {}
    offsets = [len(e) for e in echoes]
    try:
        for c, echo in zip(choices, echoes):
            if echo:
                yield sse({**head, "choices": [{"index": c.index, "text": echo, "logprobs": None,
                                                "finish_reason": None}], **extra})
        async for d in merged(rt.front, choices):
            lp = completion_logprobs(rt.tokens, d, offsets[d.index]) if body.logprobs is not None else None
            offsets[d.index] += len(d.text)
            if d.out.finished:
                finals[d.index] = d.out
            if d.text or d.finish_reason or lp:
                yield sse({**head, "choices": [{"index": d.index, "text": d.text, "logprobs": lp,
                                                "finish_reason": d.finish_reason}], **extra})
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": usage(choices, [finals[c.index] for c in choices], body.n)})
    except ApiError as exc:
        yield sse(exc.body())
    yield "data: [DONE]\n\n"


@router.get("/v1/models")
async def models(request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    return {"object": "list", "data": [{"id": rt.config.served_model_name, "object": "model",
                                        "created": rt.started, "owned_by": "tandem",
                                        "max_model_len": rt.tokens.max_context_len}]}
