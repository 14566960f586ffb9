"""Request bodies as JSON a server can use, or a 400: never a 500 later on.

`json.loads` accepts input that breaks the code after it:

    "\\ud800"            a lone UTF-16 surrogate: a str that cannot be encoded to UTF-8 (tokenizer, re-encoding)
    [[[[ ... ]]]]        deep nesting: RecursionError in json or in what walks the value
    NaN, Infinity, 1e999 floats that are not numbers
    123456789...         ints past 64 bits: OverflowError where they meet C (token ids, seeds)

`parse_json` refuses all of these with ApiError(400), plus bodies that are not UTF-8 or not
JSON. The checks past json.loads cost nothing on ordinary bodies: each runs only when a cheap
scan of the text finds what it looks for. The router parses with it (router/fast_path.py);
the worker, whose FastAPI routes parse bodies themselves, puts JsonBodies in front of them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from typing import Any

from tandem.web.errors import ApiError

MAX_DEPTH = 64  # OpenAI bodies nest a handful of levels; tool schemas a few more
INT_LIMIT = 2**63  # ints outside [-2**63, 2**63) are refused
# The depth scan's input is the body cut down to quotes and brackets (bytes.translate, C speed);
# in it a string is skipped whole and a bracket outside one counts.
_KEEP = b'[]{}"'
_DROP = bytes(b for b in range(256) if b not in _KEEP)
_TOKENS = re.compile(rb'"[^"]*"|([\[{])|([\]}])')
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# Digits to "0", the rest to " ": a run of 19 (the fewest that can reach 2**63) is then a plain search.
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_NUMBER = b"0" * 19


def _bad(message: str) -> ApiError:
    return ApiError(400, message, code="invalid_request")


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"the number {text[:40]} is out of range")
    return value


def parse_json(data: bytes) -> Any:
    """The body's value, or ApiError(400) saying what is wrong with it."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _bad(f"the body is not valid UTF-8: {exc}") from None
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_float)
    except RecursionError:
        raise _bad(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, overflowing floats, ints past Python's digit limit
        raise _bad(f"the body is not valid JSON: {exc}") from None
    if text.count("[") + text.count("{") > MAX_DEPTH and _too_deep(data):
        raise _bad(f"the body nests deeper than {MAX_DEPTH} levels")
    if "\\u" in text and _SURROGATE_ESCAPE.search(text) and not _encodable(value):
        raise _bad("the body has a lone UTF-16 surrogate (\\ud800-\\udfff) in a string; it is not valid Unicode")
    if _LONG_NUMBER in data.translate(_DIGITS) and any(_too_big(v) for v in _leaves(value)):
        raise _bad("the body has an integer outside [-2**63, 2**63); no field takes one that large")
    return value


def _too_deep(data: bytes) -> bool:
    # Escaped backslashes go first, then escaped quotes: what is left of a string is "...".
    shape = data.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _DROP)
    depth = 0
    for m in _TOKENS.finditer(shape):
        if m.lastindex == 1:
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif m.lastindex == 2:
            depth -= 1
    return False


def _leaves(value: Any) -> Iterator[Any]:
    """Every scalar and every key in a parsed value (depth is already bounded)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            yield from v.keys()
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
        else:
            yield v


def _encodable(value: Any) -> bool:
    try:
        for v in _leaves(value):
            if isinstance(v, str):
                v.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _too_big(v: Any) -> bool:
    return type(v) is int and not -INT_LIMIT <= v < INT_LIMIT


class JsonBodies:
    """ASGI middleware: a request with a body gets a 400 unless parse_json accepts it; a body that
    passes reaches the app unchanged (read once here, handed on whole)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        data = await read_body(receive)
        if data is None:  # the client left before its body was whole
            return
        if data:
            try:
                parse_json(data)
            except ApiError as exc:
                return await reply_json(send, exc.status, exc.body())
        replay = replaying(data, receive)

        await self.app(scope, replay, send)


async def read_body(receive: Any) -> bytes | None:
    """A request's whole body, or None when the client left before it was whole."""
    chunks, more = [], True
    while more:
        msg = await receive()
        if msg["type"] != "http.request":
            return None
        chunks.append(msg.get("body", b""))
        more = msg.get("more_body", False)
    return b"".join(chunks)


def replaying(data: bytes, receive: Any) -> Any:
    """An ASGI receive that hands on `data` as the whole body, then what `receive` brings (the
    disconnect, when it comes): for middleware that read the body before the app does."""
    replayed = False

    async def replay() -> dict:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": data, "more_body": False}
        return await receive()

    return replay


async def reply_json(send: Any, status: int, payload: dict) -> None:
    body = json.dumps(payload).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

