"""Logprobs under an output constraint, through a real worker, on every route, streamed and not.

A grammar mask sets the tokens it blocks to -inf, so `top_logprobs: 5` under a regex that
allows one token used to carry -inf: a 500 from the JSON encoder, and `-Infinity` (not JSON) in
a stream. Every number a route emits must be finite: a blocked token's logprob is the floor
(tandem/protocol/logprobs.py), as vLLM answers."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from structured_checks import ITEM
from worker_process import Worker

from tandem.protocol.logprobs import LOGPROB_FLOOR

REGEX = "(yes|no)"
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM}}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "yes or no?"}], "max_tokens": 24,
        "temperature": 0, "logprobs": True, "top_logprobs": 5}
CASES: list[tuple[str, dict[str, Any]]] = [
    ("/v1/completions", {"model": "tiny", "prompt": "yes or no?", "max_tokens": 8, "temperature": 0,
                         "logprobs": 5, "regex": REGEX}),
    ("/v1/completions", {"model": "tiny", "prompt": "an item:", "max_tokens": 24, "temperature": 0,
                         "logprobs": 5, "json_schema": json.dumps(ITEM)}),
    ("/v1/chat/completions", {**CHAT, "regex": REGEX}),
    ("/v1/chat/completions", {**CHAT, "response_format": SCHEMA_FORMAT}),
    ("/generate", {"text": "yes or no?", "return_logprob": True, "top_logprobs_num": 5,
                   "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": REGEX}}),
    ("/generate", {"text": "an item:", "return_logprob": True, "top_logprobs_num": 5,
                   "sampling_params": {"max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(ITEM)}}),
]


@pytest.fixture(scope="module")
def worker(model_path):
    with Worker.colocated(model_path("tiny"), "--max-total-tokens", "16384") as w:
        yield w
        assert w.pool()["whole"], w.output()


def strict_json(text: str) -> Any:
    """json.loads that refuses NaN, Infinity and -Infinity, which are not JSON."""
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON: {text[:300]}")
    return json.loads(text, parse_constant=refuse)


def numbers(obj: Any) -> list[float]:
    if isinstance(obj, float):
        return [obj]
    if isinstance(obj, dict):
        return [x for v in obj.values() for x in numbers(v)]
    if isinstance(obj, list):
        return [x for v in obj for x in numbers(v)]
    return []


def check_finite(obj: Any) -> list[float]:
    found = numbers(obj)
    assert all(math.isfinite(x) and x >= LOGPROB_FLOOR for x in found), found
    return found


def read_stream(worker: Worker, path: str, body: dict[str, Any]) -> list[Any]:
    with httpx.stream("POST", worker.url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read().decode()
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [strict_json(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    return chunks


def check_one_entry_per_token(path: str, whole: dict[str, Any]) -> None:
    """The token that ends the grammar has its logprobs too (it used to lose them)."""
    if path == "/v1/completions":
        lp = whole["choices"][0]["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]), lp
        assert len(lp["tokens"]) == whole["usage"]["completion_tokens"]
    elif path == "/v1/chat/completions":
        assert len(whole["choices"][0]["logprobs"]["content"]) == whole["usage"]["completion_tokens"]
    else:
        meta = whole["meta_info"]
        assert len(meta["output_token_logprobs"]) == len(meta["output_top_logprobs"]) == len(whole["output_ids"])


IDS = [f"{path}-{kind}" for (path, _), kind in zip(CASES, ["regex", "schema"] * 3)]


@pytest.mark.parametrize("path,body", CASES, ids=IDS)
def test_logprobs_under_a_constraint_are_finite_json(worker, path: str, body: dict[str, Any]) -> None:
    r = worker.post(path, body)
    assert r.status_code == 200, r.text
    whole = check_finite(strict_json(r.text))
    check_one_entry_per_token(path, r.json())
    # The constraint leaves fewer than 5 tokens allowed somewhere: those entries sit on the floor.
    assert LOGPROB_FLOOR in whole
    streamed = check_finite(read_stream(worker, path, body))
    assert LOGPROB_FLOOR in streamed
