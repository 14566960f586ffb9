"""`spec.apiKeySecretRef`: a reference to one key of a Secret in the InferenceService's namespace.

Only the reference is parsed here; how pods read the Secret is security/secret_env.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_SECRET_NAME_MAX = 253


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


def parse_secret_ref(raw: Any, where: str, errors: list[str]) -> SecretKeyRef | None:
    """`{name, key}` or None when absent; a malformed one is a spec error."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or not all(isinstance(raw.get(k), str) and raw.get(k) for k in ("name", "key")):
        errors.append(f"{where} needs a name and a key (strings), got {raw!r}")
        return None
    if len(raw["name"]) > _SECRET_NAME_MAX:
        errors.append(f"{where}.name is longer than {_SECRET_NAME_MAX} characters")
    return SecretKeyRef(name=raw["name"], key=raw["key"])
