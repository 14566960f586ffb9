"""Fields of an InferenceService spec that the CRD schema does not declare.

The API server prunes undeclared fields without a word (kubectl may warn, `tandem operator
render` never sees an API server), so a typo such as `prefill.replica` silently becomes the
default. `unknown_fields` walks a CR against `spec_schema.ROOT_SCHEMA` the way pruning does and
names what would be dropped, with a close declared name when there is one.

Only `spec` is walked: metadata belongs to Kubernetes and status to the operator. Subtrees
marked `x-kubernetes-preserve-unknown-fields` (pod template overrides, `engine.extra`) are
free-form, and a value of the wrong shape (a list where a map belongs) is left to the schema's
type check: this is a hint, so it never raises.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Any

Schema = dict[str, Any]
PRESERVE = "x-kubernetes-preserve-unknown-fields"


def unknown_fields(cr: Any) -> list[str]:
    """JSON paths of undeclared fields under `spec`, in document order, e.g.
    `spec.prefill.replica (did you mean replicas?)` or `spec.prefill.tolerations[0].efect (...)`."""
    from tandem.operator.spec.spec_schema import ROOT_SCHEMA  # at call time: the schema is built at import

    if not isinstance(cr, dict):
        return []
    spec_schema = _as_schema(_as_schema(ROOT_SCHEMA.get("properties")).get("spec"))
    return list(_walk(cr.get("spec"), spec_schema, "spec"))


def _as_schema(value: Any) -> Schema:
    return value if isinstance(value, dict) else {}


def _walk(value: Any, schema: Schema, path: str) -> Iterator[str]:
    """Depth is bounded by the schema's, not the value's: undeclared and free-form subtrees
    are not entered, so deep or self-referencing (YAML alias) values cannot recurse far."""
    if isinstance(value, list):
        items = schema.get("items")
        if isinstance(items, dict):
            for i, item in enumerate(value):
                yield from _walk(item, items, f"{path}[{i}]")
        return
    if not isinstance(value, dict) or schema.get("type") != "object":
        return  # a map where a scalar belongs (or int-or-string) is a type error, not unknown fields
    props = _as_schema(schema.get("properties"))
    extra = schema.get("additionalProperties")
    for key, child in value.items():
        name = str(key)
        if name in props:
            yield from _walk(child, _as_schema(props[name]), f"{path}.{name}")
        elif isinstance(extra, dict):  # a map: every key is declared, each value follows one schema
            yield from _walk(child, extra, f"{path}.{name}")
        elif extra is True or schema.get(PRESERVE) is True:
            continue  # free-form: anything goes here
        else:
            yield f"{path}.{name}" + _suggestion(name, props)


def _suggestion(name: str, declared: Schema) -> str:
    # Case-insensitive, so `ReplicaS` and `tensorparallelsize` still find their field.
    by_lower = {str(k).lower(): str(k) for k in declared}
    close = difflib.get_close_matches(name.lower(), list(by_lower), n=1)
    return f" (did you mean {by_lower[close[0]]}?)" if close else ""
