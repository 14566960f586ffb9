"""spec.model.heads against each worker role's tensorParallelSize, at reconcile.

The operator never reads the model: its weights sit on a PVC or a node path that only the pods
mount. When the user states the model's head counts (config.json's num_attention_heads and
num_key_value_heads) under spec.model.heads, a tensorParallelSize the engine would refuse is an
InvalidSpec here, before any pod starts; the rule is the engine's own
(worker_contract.tp_head_problem). Without them, the worker refuses at start and the error
reaches the CR through the pod's termination message (operator/worker_failures.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.operator.spec.field_checks import _int
from tandem.worker_contract import tp_head_problem

MAX_HEADS = 4096


@dataclass(frozen=True)
class ModelHeads:
    attention: int
    key_value: int  # equal to attention for a model without grouped-query attention


def parse_heads(raw: Any, errors: list[str]) -> ModelHeads | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        errors.append(f"spec.model.heads must be a mapping {{attention, keyValue}}, got {raw!r}")
        return None
    attention = _int(raw.get("attention"), "spec.model.heads.attention", errors, lo=1, hi=MAX_HEADS)
    kv = _int(raw.get("keyValue", attention), "spec.model.heads.keyValue", errors, lo=1, hi=MAX_HEADS)
    if attention % kv:
        # Each KV head serves a whole group of query heads: config.json numbers that differ are a typo.
        errors.append(f"spec.model.heads.keyValue ({kv}) must divide spec.model.heads.attention ({attention})")
    return ModelHeads(attention, kv)


def tp_problems(heads: ModelHeads | None, tp_sizes: Mapping[str, int]) -> list[str]:
    """One message per worker role whose tensorParallelSize the model's heads refuse."""
    if heads is None:
        return []
    problems = []
    for role, tp in tp_sizes.items():
        why = tp_head_problem(tp, heads.attention, heads.key_value)
        if why is not None:
            problems.append(f"spec.{role}.tensorParallelSize {tp} does not fit spec.model.heads: {why}")
    return problems
