"""The response encoder is the last line of defence: a number a producer forgot to floor
becomes null, never a 500 (starlette refuses NaN) nor `-Infinity` in a stream (not JSON)."""

from __future__ import annotations

import json
import math

from tandem.web.finite_json import FiniteJSONResponse, dumps, sse


def _strict(text: str) -> object:
    def refuse(name: str) -> object:
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_become_null() -> None:
    body = {"top": [[1, -math.inf], [2, math.nan]], "lp": (math.inf, -0.5), "text": "é", "ok": 1.5}
    want = {"top": [[1, None], [2, None]], "lp": [None, -0.5], "text": "é", "ok": 1.5}
    assert _strict(dumps(body)) == want
    assert _strict(FiniteJSONResponse(body).body.decode()) == want
    event = sse(body)
    assert event.startswith("data: ") and event.endswith("\n\n")
    assert _strict(event[len("data: "):]) == want


def test_finite_bodies_are_unchanged() -> None:
    body = {"a": [0.0, -9999.0, 3], "b": None, "c": "x"}
    assert dumps(body) == json.dumps(body, separators=(",", ":"))
