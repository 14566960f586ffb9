"""JSON Schemas a client sends (response_format, a tool's parameters, SGLang's json_schema):
each must be a schema under its own metaschema and fit MAX_CONSTRAINT_CHARS once serialized,
so the engine is only ever asked to compile something that means what the client wrote.

The engine compiles the text of `schema_text`: compact, non-ASCII kept, so one schema is
one text whatever the client's spacing was (the engine caches compiled grammars by text).
"""

from __future__ import annotations

import json
from typing import Any

from jsonschema.validators import Draft202012Validator, validator_for

from tandem.protocol import limits as L

# Names of the constraint kinds, as SGLang's sampling_params and the engine's SamplingParams spell them.
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")


def schema_text(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def check_schema(schema: Any, what: str) -> str:
    """The schema's text; ValueError (a 400) naming `what` when it is too long or not a schema."""
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{what} must be a JSON Schema (an object)")
    text = schema_text(schema)
    if len(text) > L.MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{what} is {len(text)} characters; at most {L.MAX_CONSTRAINT_CHARS}")
    try:
        validator_for(schema, default=Draft202012Validator).check_schema(schema)
    except Exception as exc:  # SchemaError, and a TypeError for e.g. a "$schema" that is an object
        message = getattr(exc, "message", None) or str(exc)
        raise ValueError(f"{what} is not a valid JSON Schema: {message[:500]}") from None
    return text


def check_schema_string(text: str, what: str) -> str:
    """SGLang's json_schema field: a schema sent as a string."""
    try:
        schema = json.loads(text)
    except (ValueError, RecursionError) as exc:  # a string is not bounded in depth as a body is
        raise ValueError(f"{what} is not JSON: {str(exc)[:200]}") from None
    check_schema(schema, what)
    return text
