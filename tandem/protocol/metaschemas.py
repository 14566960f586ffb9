"""Validators of a client's schema against its metaschema, at a tenth of jsonschema's own cost.

Draft 2020-12 (the default) and 2019-09 split their metaschema into vocabularies joined by
`allOf`, and recurse through `$dynamicRef` / `$recursiveRef`: jsonschema resolves a dynamic
reference by walking the dynamic scope at every subschema, ~0.4 ms each, so an `anyOf` of
8,000 empty schemas took 3.6 s. Here each is merged into one document whose recursion is a
plain `$ref: "#"`. That is the same metaschema for a schema checked on its own: the dynamic
anchor always resolves to the outermost metaschema, this one, and the vocabularies define
disjoint keywords. tests/server/test_schema_budget.py checks both agree on the error.
Drafts 3 to 7 are one document already and keep jsonschema's own.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import jsonschema_specifications
from jsonschema.protocols import Validator
from jsonschema.validators import Draft201909Validator, Draft202012Validator, validator_for

_SPLIT = {Draft202012Validator: "https://json-schema.org/draft/2020-12/",
          Draft201909Validator: "https://json-schema.org/draft/2019-09/"}
_RECURSIVE = (("$dynamicRef", "#meta"), ("$recursiveRef", "#"))


def metaschema_validator(schema: Any) -> Validator:
    """A validator of `schema` as a schema, for the draft its `$schema` names (2020-12 if none)."""
    return _validator(validator_for(schema, default=Draft202012Validator))


@cache
def _validator(cls: type[Validator]) -> Validator:
    base = _SPLIT.get(cls)
    meta = cls.META_SCHEMA if base is None else _merged(base)
    return cls(meta, format_checker=cls.FORMAT_CHECKER)


def _merged(base: str) -> dict[str, Any]:
    root = jsonschema_specifications.REGISTRY.contents(base + "schema")
    parts = [root] + [jsonschema_specifications.REGISTRY.contents(base + p["$ref"]) for p in root["allOf"]]
    properties: dict[str, Any] = {}
    defs: dict[str, Any] = {}
    for part in parts:
        for into, key in ((properties, "properties"), (defs, "$defs")):
            for name, sub in part.get(key, {}).items():
                if name in into:  # the merge is only sound while the vocabularies stay disjoint
                    raise RuntimeError(f"{base}: {key}/{name} is defined twice")
                into[name] = _local(sub)
    return {"$schema": base + "schema", "type": ["object", "boolean"], "properties": properties, "$defs": defs}


def _local(node: Any) -> Any:
    """References into one document: recursion to its root, "meta/x#/$defs/y" to "#/$defs/y"."""
    if isinstance(node, list):
        return [_local(v) for v in node]
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if (key, value) in _RECURSIVE:
            out["$ref"] = "#"
        elif key == "$ref" and isinstance(value, str):
            out["$ref"] = "#" + value.partition("#")[2]
        else:
            out[key] = _local(value)
    return out
