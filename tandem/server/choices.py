"""One choice of a completion: a request's stream turned into text deltas.

Both OpenAI endpoints (and n > 1, and batched prompts) are a list of choices run
concurrently; the endpoints only differ in how a delta is formatted. Every stream
is opened before the HTTP response starts, so 429/503/400 are real statuses, and
closed in `finally`, so a client that goes away aborts what it started.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from tandem.engine.detokenizer import TextStream
from tandem.protocol.bootstrap import Bootstrap
from tandem.protocol.messages import ReqOutput
from tandem.server.front import Front, Stream
from tandem.server.tokens import Tokens
from tandem.web.errors import ApiError, bad_request


@dataclass
class Delta:
    index: int
    text: str
    token_ids: list[int]
    out: ReqOutput  # logprobs of these tokens, usage counts, finish reason

    @property
    def finish_reason(self) -> str | None:
        if not self.out.finished:
            return None
        return (self.out.finish_reason or {}).get("kind", "stop")


@dataclass
class Choice:
    index: int
    stream: Stream
    text: TextStream
    prompt_len: int
    first: ReqOutput | None = None  # read ahead by `await_admission`, not yet yielded


def open_choices(front: Front, tokens: Tokens, jobs: list[tuple[list[int], dict[str, Any]]],
                 rid: str | None = None, skip_special_tokens: bool = True,
                 bootstrap: Bootstrap | None = None) -> list[Choice]:
    """Admit every (input_ids, sampling) job or none: a refusal closes those already opened.
    A caller's `rid` names a single job (batches are known by the front's ids only); it is
    the client's name for it, never the schedulers' key (front.py). Special tokens (a chat
    model's end-of-turn marker, ...) stay out of the text unless `skip_special_tokens` is false.
    `bootstrap` gives each job its PD room (protocol/bootstrap.py)."""
    front.admit(len(jobs))
    choices: list[Choice] = []
    try:
        rooms = bootstrap.job_bootstraps(len(jobs)) if bootstrap is not None else [{}] * len(jobs)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="bootstrap_room") from None
    try:
        for i, ((ids, sp), room) in enumerate(zip(jobs, rooms)):
            stops = sp.get("stop") or ()
            stream = front.open(ids, sp, client_rid=rid if len(jobs) == 1 else None, **room)
            stop_strings = (stops,) if isinstance(stops, str) else tuple(stops)
            choices.append(Choice(i, stream, TextStream(tokens.tok, stop_strings, skip_special_tokens), len(ids)))
    except BaseException:
        for c in choices:
            front.close(c.stream)
        raise
    return choices


def _refusal(front: Front, choice: Choice, out: ReqOutput, whole: bool = False) -> ApiError | None:
    """Refused by the scheduler before its first token (a constraint that does not compile, ...):
    an error, not an empty answer. So is a `whole` (non-streamed) answer the scheduler failed
    after some tokens (a grammar over its budget, a timeout, an engine fault): a partial answer
    cut by an error is not an answer. One aborted on purpose, by /abort_request or a drain,
    answers finish_reason abort."""
    reason = out.finish_reason or {}
    if (out.finished and reason.get("kind") == "abort" and (whole or out.completion_tokens == 0)
            and not choice.stream.aborted and reason.get("status", 400) >= 400):
        status = 503 if front.draining else reason.get("status", 400)
        return ApiError(status, reason.get("message") or "request aborted")
    return None


async def await_admission(front: Front, choices: list[Choice]) -> None:
    """Waits for every choice's first output, so that a refusal is the response's status rather
    than an error event in a stream already answered 200. For requests the scheduler may refuse
    after admission (a constraint it compiles); on any error every choice is closed."""
    try:
        for c in choices:
            c.first = await c.stream.next()
            refused = _refusal(front, c, c.first)
            if refused is not None:
                raise refused
    except BaseException:
        for c in choices:
            front.close(c.stream)
        raise


async def run_choice(front: Front, choice: Choice) -> AsyncIterator[Delta]:
    try:
        while True:
            out, choice.first = choice.first or await choice.stream.next(), None
            refused = _refusal(front, choice, out)
            if refused is not None:
                raise refused
            yield Delta(choice.index, choice.text.feed(out.token_ids, out.finished), out.token_ids, out)
            if out.finished:
                return
    finally:
        front.close(choice.stream)


async def merged(front: Front, choices: list[Choice]) -> AsyncIterator[Delta]:
    """Deltas of all choices as they arrive (one choice: no tasks at all)."""
    if len(choices) == 1:
        async for d in run_choice(front, choices[0]):
            yield d
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for d in run_choice(front, c):
                q.put_nowait(d)
        except Exception as exc:
            q.put_nowait(exc)
        finally:
            q.put_nowait(None)

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        left = len(tasks)
        while left:
            item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for c in choices:  # cancelled pumps may not have started: close here too (idempotent)
            front.close(c.stream)


async def collect(front: Front, choices: list[Choice]) -> list[list[Delta]]:
    """Non-streaming: every choice's deltas, in index order."""
    per: list[list[Delta]] = [[] for _ in choices]
    async for d in merged(front, choices):
        per[d.index].append(d)
        failed = _refusal(front, choices[d.index], d.out, whole=True)
        if failed is not None:
            raise failed
    return per


def check_model(requested: str, served: str) -> None:
    if requested != served:
        raise bad_request(f"the model {requested!r} does not exist; this server serves {served!r}",
                          code="model_not_found", param="model")
