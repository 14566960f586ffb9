"""The OpenAPI v3 schema vocabulary the InferenceService spec is written in (spec_schema.py):
one builder per node kind, each with the defaults, bounds and CEL rules the API server applies."""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def obj(props: dict[str, Schema], *, required: tuple[str, ...] = (), default: Any = None,
        rules: tuple[tuple[str, str], ...] = (), desc: str = "") -> Schema:
    out: Schema = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if default is not None:
        out["default"] = default
    if rules:
        out["x-kubernetes-validations"] = [{"rule": rule, "message": msg} for rule, msg in rules]
    if desc:
        out["description"] = desc
    return out


def integer(minimum: int | None = None, maximum: int | None = None, default: int | None = None,
            desc: str = "") -> Schema:
    out: Schema = {"type": "integer", "format": "int32"}
    for key, value in (("minimum", minimum), ("maximum", maximum), ("default", default)):
        if value is not None:
            out[key] = value
    if desc:
        out["description"] = desc
    return out


def number(minimum: float | None = None, maximum: float | None = None, default: float | None = None,
           desc: str = "", exclusive_min: bool = False) -> Schema:
    out: Schema = {"type": "number"}
    for key, value in (("minimum", minimum), ("maximum", maximum), ("default", default)):
        if value is not None:
            out[key] = value
    if exclusive_min:
        out["exclusiveMinimum"] = True
    if desc:
        out["description"] = desc
    return out


def string(*, enum: tuple[str, ...] = (), default: str | None = None, max_length: int | None = None,
           min_length: int | None = None, pattern: str | None = None, desc: str = "") -> Schema:
    out: Schema = {"type": "string"}
    if enum:
        out["enum"] = list(enum)
    if default is not None:
        out["default"] = default
    if max_length is not None:
        out["maxLength"] = max_length
    if min_length is not None:
        out["minLength"] = min_length
    if pattern is not None:
        out["pattern"] = pattern
    if desc:
        out["description"] = desc
    return out


def boolean(default: bool | None = None, desc: str = "") -> Schema:
    out: Schema = {"type": "boolean"}
    if default is not None:
        out["default"] = default
    if desc:
        out["description"] = desc
    return out


def string_map(desc: str = "") -> Schema:
    return {"type": "object", "additionalProperties": {"type": "string"}, "description": desc}


def int_or_string(default: Any = None, desc: str = "") -> Schema:
    out: Schema = {"x-kubernetes-int-or-string": True, "anyOf": [{"type": "integer"}, {"type": "string"}]}
    if default is not None:
        out["default"] = default
    if desc:
        out["description"] = desc
    return out


def free_form(desc: str) -> Schema:
    return {"type": "object", "x-kubernetes-preserve-unknown-fields": True, "description": desc}
