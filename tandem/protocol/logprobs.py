"""The floor under every logprob the server emits.

A token a grammar mask (or a broken model row) rules out has logprob -inf, and JSON has no
infinities: Python's encoder either refuses it (a 500) or writes `-Infinity`, which no strict
client parses. vLLM reports such a token at -9999.0 (the value its code says OpenAI uses); so
do we, on every route and role, from the sampler on (engine/runner/sampler.py). The PD first-token slot carries the
same finite numbers from prefill to decode.
"""

from __future__ import annotations

import math

LOGPROB_FLOOR = -9999.0


def floor_logprob(x: float) -> float:
    """A logprob as it may leave the server: -inf and NaN become the floor, never above 0."""
    if math.isnan(x):
        return LOGPROB_FLOOR
    return min(max(x, LOGPROB_FLOOR), 0.0)
