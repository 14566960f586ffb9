"""Structural defaulting, as the API server does it, from the CRD schema.

The API server defaults a CR before the operator ever sees it; applying the same
schema defaults here keeps `render` and emulator-backed tests identical to a cluster
without restating any default value in Python.
"""

from __future__ import annotations

import copy
from typing import Any

from tandem.operator.spec.spec_schema import SPEC_SCHEMA


def apply_defaults(value: Any, schema: dict[str, Any]) -> Any:
    """Return a copy of `value` with the schema's defaults filled in where fields are absent."""
    value = copy.deepcopy(value)
    _fill(value, schema)
    return value


def _fill(value: Any, schema: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, sub in schema.get("properties", {}).items():
            if key not in value and "default" in sub:
                value[key] = copy.deepcopy(sub["default"])
            if key in value:
                _fill(value[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for item in value.values():
                _fill(item, extra)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for item in value:
            _fill(item, schema["items"])


def default_spec(spec: dict[str, Any]) -> dict[str, Any]:
    return apply_defaults(spec, SPEC_SCHEMA)
