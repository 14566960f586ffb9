"""Response JSON with finite numbers only: the outbound half of json_body.py.

Python's json writes NaN and infinities as `NaN` and `-Infinity`, which are not JSON, and
starlette's JSONResponse refuses them with a ValueError, which became a 500. The producers
floor what they emit (a logprob's floor is tandem/protocol/logprobs.py), so this is defence in
depth: a number one of them missed becomes null and a logged warning, never a 500 or an event
a strict client cannot parse. The fast path is one json.dumps; only a refused value is walked.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

from fastapi.responses import JSONResponse

log = logging.getLogger(__name__)


def dumps(obj: Any) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except ValueError:
        log.warning("a response held a number that is not finite; it is sent as null")
        return json.dumps(_finite(obj), ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def sse(obj: Any) -> str:
    """One server-sent event carrying obj."""
    return f"data: {dumps(obj)}\n\n"


def _finite(obj: Any) -> Any:
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    return obj


class FiniteJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content).encode("utf-8")
