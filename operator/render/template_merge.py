"""Merging a role's pod template overrides onto the generated pod template.

Maps merge recursively; lists whose items all carry a `name` (containers, env,
volumes, volumeMounts, ports) merge item by item on that name, as a strategic merge
patch would; any other list is replaced whole. The selector labels are re-applied
afterwards by the caller so an override can never orphan a Deployment's pods.
"""

from __future__ import annotations

import copy
from typing import Any


def merge(base: Any, override: Any) -> Any:
    """Return `base` with `override` merged in; neither argument is modified."""
    if isinstance(base, dict) and isinstance(override, dict):
        out = copy.deepcopy(base)
        for key, value in override.items():
            out[key] = merge(base[key], value) if key in base else copy.deepcopy(value)
        return out
    if _named_list(base) and _named_list(override):
        return _merge_named(base, override)
    return copy.deepcopy(override)


def _named_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) and "name" in item for item in value)


def _merge_named(base: list[dict[str, Any]], override: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = [copy.deepcopy(item) for item in base]
    index = {item["name"]: pos for pos, item in enumerate(out)}
    for item in override:
        if item["name"] in index:
            out[index[item["name"]]] = merge(out[index[item["name"]]], item)
        else:
            index[item["name"]] = len(out)
            out.append(copy.deepcopy(item))
    return out
