"""Worker Services, PodDisruptionBudgets and the NetworkPolicy that keeps KV traffic in the instance
and the HTTP port to its router and named namespaces. (The gateway's own NetworkPolicy, which admits
its proxy to the decode pods, is in render/gateway.py.)"""

from __future__ import annotations

from typing import Any

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.child_meta import child_meta
from tandem.operator.security.operator_policy import OperatorPolicy
from tandem.operator.spec.service_spec import ServiceSpec


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


def generation_prefill_service(svc: ServiceSpec, generation: str) -> dict[str, Any]:
    """The prefill pods of one generation: what that generation's decode pods handshake with."""
    service = headless_service(svc, names.PREFILL)
    service["metadata"] = child_meta(svc, names.generation_name(svc.name, names.PREFILL, generation), names.PREFILL)
    service["metadata"]["labels"][names.LABEL_GENERATION] = generation
    service["spec"]["selector"] = {**service["spec"]["selector"], names.LABEL_GENERATION: generation}
    return service


def disruption_budget(svc: ServiceSpec, role: str, replicas: int) -> dict[str, Any]:
    # One pod at a time, and never the last ready one: minAvailable follows the desired count
    # (n - 1, at least 1), so a node drain waits rather than taking a role to zero. AlwaysAllow
    # still lets a crash-looping pod be evicted.
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": child_meta(svc, names.role_name(svc.name, role), role),
        "spec": {
            "minAvailable": max(1, replicas - 1),
            "selector": {"matchLabels": names.selector_labels(svc.name, role)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def _role_pods(svc: ServiceSpec, roles: tuple[str, ...]) -> dict[str, Any]:
    return {"podSelector": {
        "matchLabels": names.selector_labels(svc.name),
        "matchExpressions": [{"key": names.LABEL_COMPONENT, "operator": "In", "values": list(roles)}],
    }}


def namespaces_peer(namespaces: tuple[str, ...]) -> dict[str, Any]:
    """Every pod of these namespaces. kubernetes.io/metadata.name is the label the API server sets on
    each namespace to its own name (Kubernetes 1.22+), so no one has to label namespaces for this."""
    return {"namespaceSelector": {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "In", "values": sorted(set(namespaces))}]}}


def kv_network_policy(svc: ServiceSpec, policy: OperatorPolicy) -> dict[str, Any]:
    """Ingress to worker pods. Bootstrap and KV ports: this instance's prefill and decode pods
    only. HTTP (the OpenAI API, /metrics, admin routes): this instance's router and workers,
    plus pods of the namespaces the chart names (the operator's own, which scrapes metrics,
    and e.g. a monitoring namespace); nothing else."""
    workers = _role_pods(svc, names.WORKER_ROLES)
    kv_ports = [
        {"protocol": "TCP", "port": names.BOOTSTRAP_PORT},
        {"protocol": "TCP", "port": svc.kv.port_base, "endPort": svc.kv.port_base + svc.kv.port_count - 1},
    ]
    http_from: list[dict[str, Any]] = [_role_pods(svc, names.ROLES)]
    if policy.http_from_namespaces:
        http_from.append(namespaces_peer(policy.http_from_namespaces))
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(svc, names.network_policy_name(svc.name)),
        "spec": {
            "podSelector": workers["podSelector"],
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [workers], "ports": kv_ports},
                {"from": http_from, "ports": [{"protocol": "TCP", "port": names.HTTP_PORT}]},
            ],
        },
    }
