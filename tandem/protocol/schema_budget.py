"""One request's budget for the JSON Schemas it sends (every tool's parameters, response_format,
json_schema), charged by a cheap walk before any schema is checked against its metaschema.

The metaschema check costs per subschema and, where a metaschema says `uniqueItems` and
jsonschema cannot sort the array (mixed types, objects, booleans), per pair of items: a
draft-04 `enum` of 4,000 mixed values took 7.4 s. The walk counts what those costs grow with
and refuses past the bounds in limits.py, so the check that follows is bounded (and runs off
the event loop: schema_check.py). The walk itself stops at the first bound it passes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from jsonschema.validators import Draft3Validator, Draft4Validator, validator_for

from tandem.protocol import limits as L

# Arrays of subschemas: no metaschema asks them to be unique, so their pairs cost nothing.
_SCHEMA_LISTS = frozenset({"allOf", "anyOf", "oneOf", "prefixItems", "items"})
# Objects whose keys are names the client chose: a property called "anyOf" is no keyword.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependencies",
                        "dependentSchemas", "dependentRequired"})
_PATTERN_KEYS = frozenset({"pattern"})
# Values, not schemas: the metaschema looks inside none of them, and compares an enum's items
# pairwise only in drafts 3 and 4.
_DATA_KEYS = frozenset({"const", "default", "enum", "examples"})


class SchemaRefused(ValueError):
    """A 400: `param` names the field, the message the bound or the metaschema's complaint."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param


@dataclass
class SchemaBudget:
    """What one request's schemas have cost so far; `charge` each of them in turn."""

    nodes: int = 0
    chars: int = 0
    comparisons: int = 0
    pattern_chars: int = 0
    unique_enums: bool = False  # the schema being charged is draft 3 or 4

    def charge(self, schema: Any, text: str | None, what: str) -> str:
        """Charges `schema` and returns its text: `text` when the client sent one (SGLang's
        json_schema string), else the compact one the engine compiles, made once the walk
        has bounded the schema."""
        if not isinstance(schema, dict | bool):
            raise SchemaRefused(what, "must be a JSON Schema (an object)")
        self.unique_enums = _unique_enums(schema)
        self._walk(schema, 0, "", False, what)
        text = schema_text(schema) if text is None else text
        self.chars += len(text)
        if self.chars > L.MAX_SCHEMA_CHARS:
            raise SchemaRefused(what, f"brings this request's schemas to {self.chars} characters; at most "
                                      f"{L.MAX_SCHEMA_CHARS} (MAX_SCHEMA_CHARS) for all of them together")
        return text

    def _walk(self, node: Any, depth: int, key: str, data: bool, what: str) -> int:
        """Charges `node`, found under `key` (inside a value, not a schema, when `data`);
        returns how many JSON values it holds."""
        self.nodes += 1
        if self.nodes > L.MAX_SCHEMA_NODES:
            raise SchemaRefused(what, f"brings this request's schemas to over {L.MAX_SCHEMA_NODES} JSON values "
                                      "(MAX_SCHEMA_NODES) for all of them together")
        if isinstance(node, str) and key in _PATTERN_KEYS and not data:
            self._patterns(len(node), what)
        if not isinstance(node, dict | list) or not node:
            return 1
        if depth >= L.MAX_SCHEMA_DEPTH:
            raise SchemaRefused(what, f"nests deeper than {L.MAX_SCHEMA_DEPTH} levels (MAX_SCHEMA_DEPTH)")
        if len(node) > L.MAX_SCHEMA_ITEMS:
            raise SchemaRefused(what, f"has {'a list' if isinstance(node, list) else 'an object'} of {len(node)} "
                                      f"entries under {key or 'its root'!r}; at most {L.MAX_SCHEMA_ITEMS} "
                                      "(MAX_SCHEMA_ITEMS)")
        inner = data or key in _DATA_KEYS
        if isinstance(node, dict):
            if key == "patternProperties" and not data:
                self._patterns(sum(len(k) for k in node), what)
            named = key in _NAME_MAPS and not data
            return 1 + sum(self._walk(v, depth + 1, "" if named else k, inner, what) for k, v in node.items())
        held = 1 + sum(self._walk(v, depth + 1, "", inner, what) for v in node)
        pairwise = (key == "enum" and self.unique_enums) if inner else key not in _SCHEMA_LISTS
        if pairwise and not _sortable(node):
            # jsonschema's uniqueItems compares every pair; a comparison stops at the smaller item.
            self.comparisons += len(node) * held
            if self.comparisons > L.MAX_SCHEMA_COMPARISONS:
                raise SchemaRefused(what, f"has a list under {key or 'its root'!r} whose uniqueness check compares "
                                          f"every pair of its {len(node)} mixed items: over "
                                          f"{L.MAX_SCHEMA_COMPARISONS} (MAX_SCHEMA_COMPARISONS) in this request")
        return held

    def _patterns(self, chars: int, what: str) -> None:
        self.pattern_chars += chars
        if self.pattern_chars > L.MAX_SCHEMA_PATTERN_CHARS:
            raise SchemaRefused(what, f"brings this request's regular expressions to {self.pattern_chars} "
                                      f"characters; at most {L.MAX_SCHEMA_PATTERN_CHARS} (MAX_SCHEMA_PATTERN_CHARS)")


def _sortable(items: list[Any]) -> bool:
    """Whether jsonschema checks uniqueness by sorting (n log n) rather than pair by pair: all
    strings, or all numbers (it compares booleans as objects, which do not sort)."""
    if len(items) < 2 or all(isinstance(v, str) for v in items):
        return True
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in items)


def _unique_enums(schema: Any) -> bool:
    draft = schema.get("$schema") if isinstance(schema, dict) else None
    return isinstance(draft, str) and validator_for(schema, default=None) in (Draft3Validator, Draft4Validator)


def schema_text(schema: Any) -> str:
    return json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def charge_all(found: list[tuple[str, Any, str | None]]) -> list[tuple[str, Any, str]]:
    """One request's (field, schema, text if sent) charged to one budget, with their texts."""
    budget = SchemaBudget()
    return [(what, schema, budget.charge(schema, text, what)) for what, schema, text in found]
