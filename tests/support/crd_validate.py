"""Validate an object of a custom kind against its CRD's openAPIV3Schema offline, the way the API
server does on create: defaults first, then types and bounds, unknown fields, CEL rules.

| step | how | what the API server does differently |
|---|---|---|
| defaults | tandem.operator.spec.schema_defaults.apply_defaults | nothing for these schemas |
| types, enums, bounds, patterns, required | jsonschema Draft 4 (OpenAPI v3.0) | it checks `format` (int32) too |
| unknown fields | a walk against `properties` | it prunes them without a word; strict clients (kubectl) refuse |
| CEL rules | cel-python on every node that carries `x-kubernetes-validations` | it also bounds each rule's cost |

CEL names a property that is a CEL keyword `__keyword__` (Kubernetes' escaping), so such keys are
renamed before evaluation: `namespace` is the one the Gateway API rules use.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tandem.operator.spec.schema_defaults import apply_defaults

Schema = dict[str, Any]
# CEL's reserved words that may be property names (the language's keywords proper cannot be).
CEL_RESERVED = {"as", "break", "const", "continue", "else", "for", "function", "if", "import", "let", "loop",
                "package", "namespace", "return", "var", "void", "while"}


def problems(obj: dict[str, Any], schema: Schema) -> list[str]:
    """Every reason the API server would refuse `obj` (or prune part of it), as 'path: message'."""
    defaulted = apply_defaults(obj, schema)
    found = [f"{_path(e.absolute_path)}: {e.message}"
             for e in jsonschema.Draft4Validator(schema).iter_errors(defaulted)]
    found += [f"{path}: unknown field" for path in _unknown(obj, schema, "")]
    if not found:  # CEL runs on a well-typed object only, as on the API server
        found += list(_cel(defaulted, schema, ""))
    return found


def assert_valid(obj: dict[str, Any], schema: Schema) -> None:
    found = problems(obj, schema)
    name = f"{obj.get('kind')}/{(obj.get('metadata') or {}).get('name')}"
    assert not found, f"{name} is invalid for its CRD:\n" + "\n".join(found)


def _path(parts: Any) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parts) or "."


def _unknown(value: Any, schema: Schema, path: str) -> Iterator[str]:
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _unknown(item, schema["items"], f"{path}[{i}]")
    if not isinstance(value, dict):
        return
    props = schema.get("properties")
    extra = schema.get("additionalProperties")
    for key, child in value.items():
        if props is not None and key in props:
            yield from _unknown(child, props[key], f"{path}.{key}")
        elif isinstance(extra, dict):
            yield from _unknown(child, extra, f"{path}.{key}")
        elif props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
            yield f"{path}.{key}"
        # No properties at all (metadata): ObjectMeta, which the API server checks itself.


def _escaped(value: Any, schema: Schema) -> Any:
    """The value as CEL sees it: properties named after a CEL keyword become __keyword__."""
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_escaped(v, schema["items"]) for v in value]
    if isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        out = {}
        for key, child in value.items():
            sub = props.get(key) or (extra if isinstance(extra, dict) else {})
            name = f"__{key}__" if key in CEL_RESERVED and key in props else key
            out[name] = _escaped(child, sub)
        return out
    return value


def _cel(value: Any, schema: Schema, path: str) -> Iterator[str]:
    celpy = pytest.importorskip("celpy", reason="pip install cel-python (operator-test)")
    env = celpy.Environment()
    for check in schema.get("x-kubernetes-validations") or []:
        program = env.program(env.compile(check["rule"]))
        result = program.evaluate({"self": celpy.json_to_cel(_escaped(value, schema))})
        if not (isinstance(result, celpy.celtypes.BoolType) and bool(result)):  # False, or an evaluation error
            yield f"{path or '.'}: {check['message']} ({check['rule'][:80]}...: {result!r:.80})"
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _cel(item, schema["items"], f"{path}[{i}]")
    elif isinstance(value, dict):
        props, extra = schema.get("properties") or {}, schema.get("additionalProperties")
        for key, child in value.items():
            sub = props.get(key) or (extra if isinstance(extra, dict) else None)
            if sub is not None:
                yield from _cel(child, sub, f"{path}.{key}")
