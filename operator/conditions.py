"""Status conditions in the Kubernetes convention: lastTransitionTime moves only when status flips."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator.spec.status_schema import CONDITION_TYPES


@dataclass(frozen=True)
class Condition:
    type: str
    status: str  # "True" | "False" | "Unknown"
    reason: str
    message: str

    def __post_init__(self) -> None:
        assert self.type in CONDITION_TYPES, self.type
        assert self.status in ("True", "False", "Unknown"), self.status


def merge_conditions(previous: list[dict[str, Any]], current: list[Condition], now: str,
                     generation: int) -> list[dict[str, Any]]:
    """New condition dicts; conditions not in `current` are kept as they were, in CONDITION_TYPES order."""
    old = {c.get("type"): c for c in previous if isinstance(c, dict)}
    merged = {key: dict(value) for key, value in old.items() if key in CONDITION_TYPES}
    for cond in current:
        before = old.get(cond.type) or {}
        flipped = before.get("status") != cond.status
        merged[cond.type] = {
            "type": cond.type,
            "status": cond.status,
            "reason": cond.reason,
            "message": cond.message,
            "lastTransitionTime": now if flipped else before.get("lastTransitionTime", now),
            "observedGeneration": generation,
        }
    return [merged[key] for key in CONDITION_TYPES if key in merged]


def condition_status(conditions: list[dict[str, Any]], kind: str) -> str | None:
    for cond in conditions:
        if cond.get("type") == kind:
            return cond.get("status")
    return None
