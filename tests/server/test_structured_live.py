"""Structured outputs and tool calls end to end: `tandem serve` on the tiny model (random
weights, so only the engine's constraint makes its output valid) and the official `openai`
client. The checks shared with the routers' tests are in tests/support/structured_checks.py.

The constrained cases hold only with the engine's grammar enforcement (engine/grammar/): without
it the tiny model writes noise, and they fail."""

from __future__ import annotations

import json

import openai
import pytest
from structured_checks import (
    KW,
    TOOLS,
    WEATHER,
    calls,
    check_calls,
    check_n_choices_each_valid,
    check_parse,
    check_required_tools,
    check_streamed_calls_equal_whole,
)
from worker_process import Worker


@pytest.fixture(scope="module")
def worker(model_path):
    with Worker.colocated(model_path("tiny"), "--max-total-tokens", "16384", "--tool-call-parser", "hermes",
                          "--reasoning-parser", "qwen3") as w:
        yield w
        assert w.pool()["whole"], w.output()


def test_parse_returns_the_pydantic_object(client) -> None:
    check_parse(client)


def test_n_choices_each_satisfy_the_schema(client) -> None:
    check_n_choices_each_valid(client)


def test_json_object_is_a_json_object(client) -> None:
    """Any object: its strings are unbounded, and the tiny model may fill max_tokens with one."""
    r = client.chat.completions.create(response_format={"type": "json_object"}, **KW)
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_required_returns_calls_that_fit_their_schemas(client) -> None:
    check_required_tools(client)
    one = client.chat.completions.create(tools=TOOLS, tool_choice="required", parallel_tool_calls=False, **KW)
    assert len(one.choices[0].message.tool_calls) == 1


def test_a_named_function_is_called_with_valid_arguments(client) -> None:
    r = client.chat.completions.create(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_time"}},
                                       **KW)
    found = calls(r.choices[0].message)
    assert [name for name, _ in found] == ["get_time"]
    check_calls(found)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_accumulate_to_the_non_streamed_ones(client, choice) -> None:
    check_streamed_calls_equal_whole(client, choice)


def test_sglang_regex_on_completions(client) -> None:
    r = client.completions.create(model="tiny", prompt="yes or no?", max_tokens=16, temperature=0,
                                  extra_body={"regex": "(yes|no)"})
    assert r.choices[0].text in ("yes", "no")


def test_a_constraint_that_does_not_compile_is_a_400(client) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError):
            r = client.chat.completions.create(extra_body={"regex": "(unclosed"}, stream=stream, **KW)
            list(r) if stream else r


def test_auto_tools_and_plain_chat_answer_on_any_model(client) -> None:
    """No constraint: the tiny model's noise is content, and nothing breaks on the way."""
    r = client.chat.completions.create(tools=TOOLS, **{**KW, "max_tokens": 24})
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    chunks = list(client.chat.completions.create(tools=TOOLS, stream=True, **{**KW, "max_tokens": 24}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (r.choices[0].message.content or "")
    plain = client.chat.completions.create(**{**KW, "max_tokens": 8})
    assert plain.choices[0].message.content and plain.choices[0].message.tool_calls is None


def test_bad_shapes_are_bad_requests(client) -> None:
    for kw in (dict(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "nope"}}}),
               dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}),
               dict(tools=[WEATHER, WEATHER])):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(**KW, **kw)
