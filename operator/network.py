"""Worker Services, PodDisruptionBudgets and the NetworkPolicy that keeps KV traffic in the instance."""

from __future__ import annotations

from typing import Any

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.meta import child_meta
from tandem.operator.spec import ServiceSpec


def headless_service(svc: ServiceSpec, role: str) -> dict[str, Any]:
    """Stable per-pod DNS for a worker role; the router discovers pods itself, this is for humans and NIXL."""
    ports = [{"name": name, "port": port, "targetPort": name, "protocol": "TCP"}
             for name, port in contract.worker_ports(role, svc.kv.port_base)]
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(svc, names.role_name(svc.name, role), role),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": names.selector_labels(svc.name, role),
            "ports": ports,
        },
    }


def disruption_budget(svc: ServiceSpec, role: str) -> dict[str, Any]:
    # One pod at a time: evictions then never take out a whole role, and the drain of one pod
    # finishes before the next starts. AlwaysAllow lets a crash-looping pod be evicted anyway.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(svc, names.role_name(svc.name, role), role),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": names.selector_labels(svc.name, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def kv_network_policy(svc: ServiceSpec) -> dict[str, Any]:
    """Bootstrap and KV ports accept only this instance's workers; the HTTP port stays open."""
    instance = {"matchLabels": names.selector_labels(svc.name)}
    workers = {
        "matchLabels": names.selector_labels(svc.name),
        "matchExpressions": [{
            "key": names.LABEL_COMPONENT, "operator": "In", "values": list(names.WORKER_ROLES),
        }],
    }
    kv_ports = [
        {"protocol": "TCP", "port": names.BOOTSTRAP_PORT},
        {"protocol": "TCP", "port": svc.kv.port_base, "endPort": svc.kv.port_base + svc.kv.port_count - 1},
    ]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(svc, names.network_policy_name(svc.name)),
        "spec": {
            "podSelector": workers,
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": instance}], "ports": kv_ports},
                {"ports": [{"protocol": "TCP", "port": names.HTTP_PORT}]},
            ],
        },
    }
