"""OpenAI's /v1/chat/completions: the chat template (with the offered tools), the output
constraint of response_format or a forced tool choice, and each choice's text turned into
reasoning, content and tool calls (assistant_output.py).

Streamed, a chunk's delta carries what its tokens settle: `reasoning_content`, `content`,
`tool_calls` (each call's first piece has its id, type and name; the `arguments` pieces
concatenate to its arguments). Text that may open a tool call is held until the call is
whole or turns out to be text, so markers never reach the content.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from tandem.protocol.chat_api import ChatCompletionRequest
from tandem.server.assistant_output import AssistantParser, assistant_parser
from tandem.server.choices import Choice, Delta, await_admission, check_model, collect, merged, open_choices
from tandem.server.openai_routes import usage
from tandem.server.runtime import Runtime
from tandem.server.schema_step import check_schemas
from tandem.server.tokens import Tokens
from tandem.web.disconnect import cancel_on_disconnect
from tandem.web.errors import ApiError
from tandem.web.finite_json import FiniteJSONResponse, sse

router = APIRouter()


def chat_logprobs(tokens: Tokens, d: Delta) -> dict[str, Any]:
    def entry(t: int, lp: float) -> dict[str, Any]:
        s = tokens.token_text(int(t))
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    tops = d.out.top_logprobs or [[] for _ in d.token_ids]
    return {"content": [{**entry(t, lp), "top_logprobs": [entry(int(a), b) for a, b in top]}
                        for t, lp, top in zip(d.token_ids, d.out.logprobs or [], tops)]}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
    rt: Runtime = request.app.state.runtime
    rt.check_bootstrap(body)
    check_model(body.model, rt.config.served_model_name)
    await check_schemas(body.schemas)
    ids = await rt.tokens.chat_ids(body.template_messages(), body.template_tools())
    budget = rt.tokens.max_new_tokens(len(ids), body.max_new_tokens)
    top = (body.top_logprobs or 0) if body.logprobs else None
    jobs = [(ids, body.sampling(budget, i, top, rt.default_seed)) for i in range(body.n)]
    choices = open_choices(rt.front, rt.tokens, jobs,
                           skip_special_tokens=body.skip_special_tokens, bootstrap=body)
    parsers = [assistant_parser(body, rt.tool_format, rt.config.reasoning_parser) for _ in choices]
    head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": rt.config.served_model_name}
    if body.stream:
        if body.constraint_sources:  # a constraint that does not compile is a 400, not an error event
            await cancel_on_disconnect(request, await_admission(rt.front, choices))
        return StreamingResponse(_stream_chat(rt, body, choices, parsers, head), media_type="text/event-stream")
    per = await cancel_on_disconnect(request, collect(rt.front, choices))
    out_choices = []
    for c, deltas, parser in zip(choices, per, parsers):
        lp = None
        if body.logprobs:
            lp = {"content": [e for d in deltas for e in chat_logprobs(rt.tokens, d)["content"]]}
        whole = parser.feed(c.text.text, final=True)
        out_choices.append({"index": c.index, "message": parser.message(whole), "logprobs": lp,
                            "finish_reason": parser.finish_reason(deltas[-1].finish_reason)})
    return FiniteJSONResponse({**head, "object": "chat.completion", "choices": out_choices,
                               "usage": usage(choices, [d[-1].out for d in per], body.n)})


async def _stream_chat(rt: Runtime, body: ChatCompletionRequest, choices: list[Choice],
                       parsers: list[AssistantParser], head: dict) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk", **({"usage": None} if body.include_usage else {})}
    finals: dict[int, Any] = {}
    try:
        for c, parser in zip(choices, parsers):
            # Content starts "" only where it is never null (no parser may turn the text into calls).
            first = {"role": "assistant", "content": ""} if parser.plain else {"role": "assistant"}
            yield sse({**head, "choices": [{"index": c.index, "delta": first, "logprobs": None,
                                            "finish_reason": None}]})
        async for d in merged(rt.front, choices):
            parser = parsers[d.index]
            lp = chat_logprobs(rt.tokens, d) if body.logprobs else None
            if d.out.finished:
                finals[d.index] = d.out
            delta = parser.feed(d.text, d.out.finished).to_openai()
            reason = parser.finish_reason(d.finish_reason)
            if delta or reason or lp:
                yield sse({**head, "choices": [{"index": d.index, "delta": delta, "logprobs": lp,
                                                "finish_reason": reason}]})
        if body.include_usage:
            yield sse({**head, "choices": [], "usage": usage(choices, [finals[c.index] for c in choices], body.n)})
    except ApiError as exc:
        yield sse(exc.body())
    yield "data: [DONE]\n\n"
