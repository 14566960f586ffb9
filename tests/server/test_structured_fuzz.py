"""A hypothesis campaign over the structured-output surfaces combined: response_format, tools,
regex, ebnf, logprobs, n and stream, on all three routes, at a worker and through the router.

Every answer must be below 500 and strict JSON (no NaN, no Infinity: `parse_constant` refuses
them), streamed or whole; every number a 200 carries is finite. Afterwards both processes
answer /health and the pool is whole. The bodies are small (max_tokens <= 24) so the campaign
costs seconds, not minutes; the hostile *sizes* are in test_hostile_requests.py and
test_hostile_up.py."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from json_schemas import TOP
from worker_process import Worker


def _strict(text: str) -> Any:
    def refuse(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_finite(v) for v in value)
    return True


REGEXES = st.sampled_from([r"[ab]{1,6}", r"(yes|no)", r"\d{1,4}", r"x*", r"(a|aa)*b", r"[^\n]{0,8}"])
EBNFS = st.sampled_from([
    'root ::= "yes" | "no"',
    'root ::= ("a" | "b")+ "."',
    'root ::= item ("," item)*\nitem ::= [0-9]+',
    'root ::= (x | "x" | "xx")*\nx ::= "x" | "xx"',  # ambiguous: the matcher budget's kind of grammar
])
TOOL = st.builds(lambda name, schema: {"type": "function", "function": {"name": name, "parameters": schema}},
                 st.text("abcdefgh", min_size=1, max_size=6),
                 TOP.filter(lambda s: s.get("type") == "object"))
CONSTRAINT = st.one_of(
    st.none(),
    st.builds(lambda s: {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}, TOP),
    st.just({"response_format": {"type": "json_object"}}),
    st.builds(lambda r: {"regex": r}, REGEXES),
    st.builds(lambda e: {"ebnf": e}, EBNFS),
)
COMMON = st.fixed_dictionaries({
    "max_tokens": st.integers(1, 24),
    "n": st.integers(1, 3),
    "stream": st.booleans(),
    "temperature": st.sampled_from([0.0, 0.7, 1.5]),
    "seed": st.integers(0, 2**31),
})


@st.composite
def bodies(draw: st.DrawFn) -> tuple[str, dict[str, Any]]:
    route = draw(st.sampled_from(["/v1/chat/completions", "/v1/completions", "/generate"]))
    common, constraint = draw(COMMON), draw(CONSTRAINT) or {}
    top = draw(st.none() | st.integers(0, 5))
    if route == "/generate":
        sp: dict[str, Any] = {"max_new_tokens": common["max_tokens"], "temperature": common["temperature"]}
        for kind in ("regex", "ebnf"):
            if kind in constraint:
                sp[kind] = constraint[kind]
        if "response_format" in constraint and "json_schema" in constraint["response_format"]:
            sp["json_schema"] = json.dumps(constraint["response_format"]["json_schema"]["schema"])
        body: dict[str, Any] = {"text": "hello", "sampling_params": sp, "stream": common["stream"]}
        if top is not None:
            body |= {"return_logprob": True, "top_logprobs_num": top}
        return route, body
    body = {"model": "tiny", **common, **constraint}
    if route == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hi"}]
        if top is not None:
            body |= {"logprobs": True, "top_logprobs": top}
        if draw(st.booleans()) and "response_format" not in constraint:
            body |= {"tools": draw(st.lists(TOOL, min_size=1, max_size=3, unique_by=lambda t: t["function"]["name"])),
                     "tool_choice": draw(st.sampled_from(["auto", "required", "none"]))}
    else:
        body.pop("response_format", None)  # completions take regex / ebnf / json_schema, not response_format
        body["prompt"] = "hello"
        if top is not None:
            body["logprobs"] = top
    return route, body


def _check(response: httpx.Response, stream: bool, what: str) -> None:
    assert response.status_code < 500, (what, response.text[:500])
    if response.status_code != 200:
        assert "error" in _strict(response.text) or "detail" in _strict(response.text), (what, response.text[:500])
        return
    if not stream:
        payload = _strict(response.text)
        assert _finite(payload), (what, response.text[:500])
        return
    for line in response.text.splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            chunk = _strict(line[5:])
            assert _finite(chunk), (what, line[:500])


@pytest.fixture(scope="module")
def fuzz_worker(model_path):
    with Worker.colocated(model_path("tiny"), "--max-total-tokens", "16384") as w:
        yield w
        assert w.get("/health").status_code == 200, w.output()
        assert w.pool()["whole"], w.output()


@pytest.fixture(scope="module")
def fuzz_router(fuzz_worker, model_path):
    with Worker.router(model_path("tiny"), workers=[fuzz_worker]) as r:
        yield r
        assert r.get("/health").status_code == 200, r.output()


@given(bodies())
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_structured_combinations_never_5xx_and_emit_strict_json(fuzz_worker, case) -> None:
    route, body = case
    response = httpx.post(fuzz_worker.url + route, json=body, timeout=120)
    _check(response, bool(body.get("stream")), f"{route} {json.dumps(body)[:400]}")


@given(bodies())
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_structured_combinations_through_the_router(fuzz_router, case) -> None:
    route, body = case
    response = httpx.post(fuzz_router.url + route, json=body, timeout=120)
    _check(response, bool(body.get("stream")), f"{route} {json.dumps(body)[:400]}")
