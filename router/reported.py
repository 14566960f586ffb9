"""What a worker's answer reports, read from its bytes without decoding it: token counts for
the router's metrics, and the message of an error answer.

Token counts come from an OpenAI `usage` object or SGLang's `meta_info`, both of which spell them
`prompt_tokens` and `completion_tokens`. A whole answer sums them (/generate with n > 1 answers
one object per choice); a stream takes the last, since /generate's events carry running counts.
"""

from __future__ import annotations

import json
import re

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens":\s*(\d+)')
_PROMPT_TOKENS = re.compile(rb'"prompt_tokens":\s*(\d+)')


def output_tokens(body: bytes, default: int | None, last: bool = False) -> int | None:
    """completion_tokens in `body`; `default` without."""
    return _count(_COMPLETION_TOKENS, body, default, last)


def prompt_tokens(body: bytes, default: int | None, last: bool = False) -> int | None:
    """prompt_tokens in `body`; `default` without."""
    return _count(_PROMPT_TOKENS, body, default, last)


def _count(pattern: re.Pattern[bytes], body: bytes, default: int | None, last: bool) -> int | None:
    found = pattern.findall(body)
    if not found:
        return default
    return int(found[-1]) if last else sum(int(x) for x in found)


def error_message(text: str, status: int) -> str:
    """The message of an OpenAI error JSON, else the text itself (cut), else the status."""
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500] or f"worker answered {status}"
