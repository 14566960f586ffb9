"""A request's JSON Schemas are charged to one budget while its body parses, and only then
checked against their metaschemas (protocol/schema_budget.py, schema_check.py). The slow
schemas of issue 38 (a draft-04 enum of mixed values, an anyOf of thousands of empty schemas,
128 large tools) took seconds of the event loop; they are now 400s naming the bound before any
metaschema work, while 128 realistic tools still pass. The merged 2020-12 and 2019-09
metaschemas (protocol/metaschemas.py) must say what jsonschema's own say."""

from __future__ import annotations

import json
from typing import Any

import pytest
from jsonschema.exceptions import best_match
from jsonschema.validators import Draft201909Validator, Draft202012Validator
from pydantic import ValidationError

from tandem.protocol import limits as L
from tandem.protocol.chat_api import ChatCompletionRequest
from tandem.protocol.metaschemas import metaschema_validator
from tandem.protocol.openai_api import GenerateRequest
from tandem.protocol.schema_check import ValidatedSchemas

USER = [{"role": "user", "content": "hi"}]
DRAFT4 = "http://json-schema.org/draft-04/schema#"


def response_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}


def tool(i: int, parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": f"tool_{i}", "parameters": parameters}}


def realistic(i: int) -> dict[str, Any]:
    """A tool as agents send them: four typed, described parameters, an enum, required ones."""
    return tool(i, {"type": "object", "title": f"tool {i}", "properties": {
        "path": {"type": "string", "description": "Absolute path of the file to read."},
        "offset": {"type": "integer", "minimum": 0, "description": "Line to start at."},
        "mode": {"type": "string", "enum": ["read", "write", "append"], "description": "How to open it."},
        "tags": {"type": "array", "items": {"type": "string"}, "description": "Labels."}},
        "required": ["path", "mode"], "additionalProperties": False})


def chat(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **extra}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {}
    for _ in range(depth):
        schema = {"items": schema}
    return schema


HOSTILE = {  # issue 38's reports (7.4 s, 3.6 s, 27 s), and just past each bound
    "a draft-04 enum of 4,000 mixed values": (
        chat(response_format=response_format({"$schema": DRAFT4, "enum": ["a", *range(3999)]})), "MAX_SCHEMA_ITEMS"),
    "a draft-04 enum of 500 mixed values": (
        chat(response_format=response_format({"$schema": DRAFT4, "enum": ["a", *range(499)]})),
        "MAX_SCHEMA_COMPARISONS"),
    "an anyOf of 8,000 empty schemas": (chat(response_format=response_format({"anyOf": [{}] * 8000})),
                                        "MAX_SCHEMA_ITEMS"),
    "128 large tools": (chat(tools=[tool(i, {"type": "object", "properties": {
        f"p{j}": {"type": "string", "description": "x" * 40} for j in range(200)}}) for i in range(128)]),
        "MAX_SCHEMA_NODES"),
    "tools whose text passes the bound together": (chat(tools=[tool(i, {"description": "x" * (L.MAX_SCHEMA_CHARS // 4)})
                                                               for i in range(4)]), "MAX_SCHEMA_CHARS"),
    "a schema nested 40 deep": (chat(response_format=response_format(nested(40))), "MAX_SCHEMA_DEPTH"),
    "long regular expressions": (chat(tools=[tool(i, {"type": "string", "pattern": "a" * 4000}) for i in range(5)]),
                                 "MAX_SCHEMA_PATTERN_CHARS"),
}


@pytest.fixture
def no_metaschema_work(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Records every metaschema check jsonschema is asked for."""
    calls: list[Any] = []
    for cls in (Draft202012Validator, Draft201909Validator):
        real = cls.iter_errors

        def recording(self: Any, instance: Any, *a: Any, _real: Any = real, **kw: Any) -> Any:
            calls.append(instance)
            return _real(self, instance, *a, **kw)

        monkeypatch.setattr(cls, "iter_errors", recording)
    return calls


@pytest.mark.parametrize(("body", "bound"), HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_schemas_are_refused_by_the_budget_before_any_metaschema_work(
        body: dict[str, Any], bound: str, no_metaschema_work: list[Any]) -> None:
    with pytest.raises(ValidationError, match=bound):
        ChatCompletionRequest.model_validate(body)
    assert no_metaschema_work == []


def test_the_budget_covers_every_schema_of_a_request_and_generate() -> None:
    """Two tools fit; with a response_format as large they do not."""
    each = {"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(1000)}}
    ChatCompletionRequest.model_validate(chat(tools=[tool(0, each), tool(1, each)]))
    with pytest.raises(ValidationError, match="MAX_SCHEMA_NODES"):
        ChatCompletionRequest.model_validate(chat(tools=[tool(0, each), tool(1, each)],
                                                  response_format=response_format(each)))
    many = '{"anyOf": [' + ",".join(["{}"] * 2000) + "]}"
    with pytest.raises(ValidationError, match="MAX_SCHEMA_ITEMS"):
        GenerateRequest.model_validate({"text": "x", "sampling_params": {"json_schema": many}})


def test_128_realistic_tools_pass_and_a_resent_set_is_not_checked_again() -> None:
    body = ChatCompletionRequest.model_validate(chat(tools=[realistic(i) for i in range(L.MAX_TOOLS)]))
    cache = ValidatedSchemas()
    assert cache.check(body.schemas) == L.MAX_TOOLS
    assert cache.check(body.schemas) == 0  # the agent's next turn: digests only


def test_the_cache_of_passed_schemas_is_bounded() -> None:
    cache = ValidatedSchemas(max_entries=2)
    one, two, three = ([("s", {"title": t}, f'{{"title":"{t}"}}')] for t in "abc")
    assert [cache.check(s) for s in (one, two, three, one)] == [1, 1, 1, 1]  # `one` was evicted by `three`
    assert cache.check(three) == 0


def test_a_refused_schema_is_not_remembered() -> None:
    cache = ValidatedSchemas()
    bad = [("response_format.json_schema.schema", {"type": "objekt"}, '{"type":"objekt"}')]
    for _ in range(2):
        with pytest.raises(ValueError, match="response_format.json_schema.schema is not a valid JSON Schema"):
            cache.check(bad)


SCHEMAS = [
    {}, True, {"anyOf": []}, {"type": "objekt"}, {"type": ["string", "string"]}, {"pattern": "("},
    {"properties": {"a": {"type": 3}}}, {"$defs": {"x": {"minimum": "a"}}}, {"definitions": {"x": {"minimum": "a"}}},
    {"dependencies": {"x": ["a", "a"]}}, {"dependencies": {"x": {"type": 1}}}, {"dependentRequired": {"a": [1]}},
    {"items": {"items": {"items": {"maxItems": -1}}}}, {"$id": "x#frag"}, {"$anchor": "1x"}, {"required": ["a", "a"]},
    {"contentMediaType": 3}, {"unevaluatedProperties": {"type": 3}}, {"deprecated": "x"}, {"format": 3},
    {"$recursiveRef": 3}, {"prefixItems": [{"enum": []}]}, {"if": {"const": 1}, "then": {"minLength": -1}},
    {"patternProperties": {"(": {}}}, {"propertyNames": {"type": "strin"}}, {"$ref": "#/$defs/a", "$defs": {"a": {}}},
    {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}}, "required": ["a"]},
]


@pytest.mark.parametrize("draft", [Draft202012Validator, Draft201909Validator])
@pytest.mark.parametrize("schema", SCHEMAS)
def test_the_merged_metaschemas_say_what_jsonschemas_own_say(draft: type, schema: Any) -> None:
    if isinstance(schema, dict):
        schema = {"$schema": draft.META_SCHEMA["$id"], **schema}
    ours = best_match(metaschema_validator(schema).iter_errors(schema))
    theirs = best_match(draft(draft.META_SCHEMA, format_checker=draft.FORMAT_CHECKER).iter_errors(schema))
    assert (ours and ours.message) == (theirs and theirs.message)


def test_the_merge_is_one_document_with_no_dynamic_reference() -> None:
    text = json.dumps(metaschema_validator({}).schema)
    assert '"#meta"' not in text and "meta/" not in text
