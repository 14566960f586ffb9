"""Scale-down removes the least-loaded pods: `controller.kubernetes.io/pod-deletion-cost` from load.

When a Deployment scales down, its ReplicaSet deletes the pods with the lowest deletion cost
first (after unscheduled and unready ones). Before lowering a worker role's count the
operator sets each ready pod's cost to its load at the last scrape (waiting + running
requests, x100 to keep a fraction's order), so the pods it removes are the ones with the
fewest in-flight streams, and their preStop drain has the least to finish. Only pods whose
cost changes are patched, and only ahead of a scale-down, so steady state costs no writes.
"""

from __future__ import annotations

from typing import Any

from tandem.operator.kubeapi import KubeApi

ANNOTATION = "controller.kubernetes.io/pod-deletion-cost"
INT32_MAX = 2**31 - 1


def cost(load: float) -> int:
    return max(0, min(INT32_MAX, round(load * 100)))


def patches(pods: list[dict[str, Any]], loads: dict[str, float]) -> dict[str, int]:
    """Pod name -> new cost, for pods with a known load whose annotation differs."""
    out = {}
    for pod in pods:
        meta = pod.get("metadata") or {}
        name = meta.get("name")
        if name not in loads or meta.get("deletionTimestamp"):
            continue
        value = cost(loads[name])
        if (meta.get("annotations") or {}).get(ANNOTATION) != str(value):
            out[name] = value
    return out


async def mark(api: KubeApi, namespace: str, pods: list[dict[str, Any]], loads: dict[str, float]) -> int:
    todo = patches(pods, loads)
    for name, value in todo.items():
        await api.merge_patch("v1", "Pod", namespace, name, {"metadata": {"annotations": {ANNOTATION: str(value)}}})
    return len(todo)
