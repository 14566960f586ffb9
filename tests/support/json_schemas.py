"""Generated JSON schemas for the structured-output property tests (engine, PD): objects,
arrays, enums, bounded strings and integers, nested.

Strings and arrays carry maxLength / maxItems, and TOP keeps only schemas whose longest answer
fits TOKEN_BUDGET tokens, so that a model that prefers no token in particular (the tiny model has
random weights) still closes every value within the budget.
"""

from __future__ import annotations

import json
from typing import Any

import jsonschema
from hypothesis import strategies as st

NAMES = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8)
LEAVES = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 12)),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-1000, 1000), st.integers(0, 5000)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda xs: {"enum": xs}, st.lists(st.one_of(NAMES, st.integers(-9, 99), st.booleans()),
                                               min_size=1, max_size=4, unique=True)),
)


def _object(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict[str, Any], required_mask: list[bool]) -> dict[str, Any]:
        names = list(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, r in zip(names, required_mask) if r]}

    return st.dictionaries(NAMES, children, min_size=1, max_size=4).flatmap(
        lambda props: st.builds(build, st.just(props), st.lists(st.booleans(), min_size=len(props),
                                                                   max_size=len(props))))


def _array(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.builds(lambda item, n: {"type": "array", "items": item, "maxItems": n}, children, st.integers(0, 3))


# The tests' max_new_tokens: every generated schema's longest answer fits in it (worst_tokens).
TOKEN_BUDGET = 256
# A string character may take six tokens: a \uXXXX escape is six ASCII characters, a token
# holds at least one byte (a raw 4-byte character is at most four tokens).
_STRING_CHAR = 6


def worst_tokens(schema: dict[str, Any]) -> int:
    """Tokens of the longest compact answer `schema` admits (xgrammar's separators ", " and ": ",
    every optional property present, every array full): a token holds at least one byte, and
    outside strings every character is one byte."""
    if "enum" in schema:
        return max(len(json.dumps(x)) for x in schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return 2 + _STRING_CHAR * schema["maxLength"]
    if kind == "integer":
        return max(len(str(schema["minimum"])), len(str(schema["maximum"])))
    if kind in ("boolean", "null"):
        return 5
    if kind == "array":
        n = schema["maxItems"]
        return 2 + n * worst_tokens(schema["items"]) + 2 * max(0, n - 1)
    props = schema["properties"]
    return 2 + sum(len(json.dumps(k)) + 2 + worst_tokens(v) for k, v in props.items()) + 2 * max(0, len(props) - 1)


SCHEMAS = st.recursive(LEAVES, lambda c: st.one_of(_object(c), _array(c)), max_leaves=8)
# A top-level object, as response_format json_schema asks for, whose every answer fits the
# budget: a random-weight model may well write the longest one (the bound filters ~30%).
TOP = _object(SCHEMAS).filter(lambda schema: worst_tokens(schema) <= TOKEN_BUDGET)


def assert_valid(text: str, schema: dict[str, Any]) -> None:
    """`text` is JSON that satisfies `schema`; the failure names both."""
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError) as exc:
        raise AssertionError(f"{text!r} against {json.dumps(schema)}: {exc}") from exc
