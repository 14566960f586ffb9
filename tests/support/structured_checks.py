"""The structured-output and tool-call checks a client runs against any front: `tandem serve`
directly, `tandem router` (colocated and PD) and sglang-router. Schemas are bounded (short
strings, enums, no extra properties) so that a constrained answer from the random-weight
tiny model finishes well within max_tokens; without the engine's constraint it writes noise."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
from pydantic import BaseModel

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
    "additionalProperties": False}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
KW: dict[str, Any] = dict(model="tiny", messages=USER, max_tokens=200, temperature=0, seed=7)
ITEM = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                         "count": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "count"], "additionalProperties": False}


class Answer(BaseModel):
    ok: bool
    color: Literal["red", "green", "blue"]


def calls(message: Any) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def check_calls(found: list[tuple[str, dict]]) -> None:
    assert found
    for name, args in found:
        jsonschema.validate(args, SCHEMAS[name])


def check_parse(client: Any, **kw: Any) -> None:
    """The openai client's parse() with a pydantic model returns the parsed object."""
    r = client.chat.completions.parse(response_format=Answer, **{**KW, **kw})
    assert isinstance(r.choices[0].message.parsed, Answer), r.choices[0].message.content


def check_n_choices_each_valid(client: Any, **kw: Any) -> None:
    """n sampled choices under one json_schema: each choice has its own matcher and seed."""
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
    r = client.chat.completions.create(response_format=fmt, n=3, **{**KW, "temperature": 1.0, **kw})
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), ITEM)
    assert len({c.message.content for c in r.choices}) > 1  # sampled, not one answer copied


def check_required_tools(client: Any, **kw: Any) -> None:
    r = client.chat.completions.create(tools=TOOLS, tool_choice="required", **{**KW, **kw})
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    check_calls(calls(r.choices[0].message))


def check_streamed_calls_equal_whole(client: Any, choice: Any, **kw: Any) -> None:
    """A streamed tool call assembles into the non-streamed one."""
    whole = client.chat.completions.create(tools=TOOLS, tool_choice=choice, **{**KW, **kw})
    with client.chat.completions.stream(tools=TOOLS, tool_choice=choice, **{**KW, **kw}) as stream:
        streamed = stream.get_final_completion()
    assert calls(streamed.choices[0].message) == calls(whole.choices[0].message)
    assert streamed.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"
    check_calls(calls(whole.choices[0].message))
