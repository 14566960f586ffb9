"""reconcile(cr) -> the desired children: pure, idempotent, level-based.

It reads the CR's spec and, when the operator's autoscaler is on, the replica counts
the autoscaler last persisted in status.autoscaler. Calling it twice on the same CR
gives the same manifests, which is what makes server-side apply on every trigger
(create, update, resume, timer) safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator import names
from tandem.operator.render.engine_configmap import engine_configmap
from tandem.operator.render.gateway import gateway_children
from tandem.operator.render.network import (
    disruption_budget,
    generation_prefill_service,
    headless_service,
    kv_network_policy,
)
from tandem.operator.render.router_children import router_deployment, router_rbac, router_service
from tandem.operator.render.worker_deployment import worker_deployment
from tandem.operator.rollout.generation_hash import generation_of
from tandem.operator.scaling.decision import clamp
from tandem.operator.scaling.role_scaler import role_scaler
from tandem.operator.security.harden import harden_deployment
from tandem.operator.security.operator_policy import OperatorPolicy, policy_problems
from tandem.operator.spec.pd_ratio import Pair, nearest_feasible
from tandem.operator.spec.service_spec import ServiceSpec, SpecError, parse_service

# Children of CRDs outside Kubernetes (GIE's, Gateway API's): without them in the cluster, sync.py
# reports a condition and reconciles the rest, rather than failing the whole service. The route
# comes after the pool it points at.
GATEWAY_KINDS = (
    (names.INFERENCE_POOL_API_VERSION, "InferencePool"),
    (names.HTTP_ROUTE_API_VERSION, "HTTPRoute"),
)
OPTIONAL_KINDS = frozenset(GATEWAY_KINDS)
# Children are applied in this order: config and identities before the pods that use them; last,
# the kinds a cluster may lack, so a missing one never holds up the pods.
CHILD_KINDS = (
    ("v1", "ConfigMap"),
    ("v1", "ServiceAccount"),
    ("rbac.authorization.k8s.io/v1", "Role"),
    ("rbac.authorization.k8s.io/v1", "RoleBinding"),
    ("v1", "Service"),
    ("networking.k8s.io/v1", "NetworkPolicy"),
    ("policy/v1", "PodDisruptionBudget"),
    (names.API_VERSION, "RoleScaler"),
    ("apps/v1", "Deployment"),
    *GATEWAY_KINDS,
)


@dataclass(frozen=True)
class RoleReplicas:
    prefill: int
    decode: int
    router: int

    def of(self, role: str) -> int:
        return {names.PREFILL: self.prefill, names.DECODE: self.decode, names.ROUTER: self.router}[role]


def _autoscaled(svc: ServiceSpec, status: dict[str, Any], role: str) -> int:
    spec = svc.role(role)
    state = (status.get("autoscaler") or {}).get(role) or {}
    count = state.get("replicas")
    # A change to spec replicas (kubectl edit, `kubectl scale` via /scale) restarts the autoscaler there.
    if state.get("specReplicas") != spec.replicas or not isinstance(count, int):
        count = spec.replicas
    return clamp(count, spec.min_replicas, spec.max_replicas)


def _count(svc: ServiceSpec, status: dict[str, Any], external: dict[str, int], role: str) -> int:
    spec = svc.role(role)
    if role in svc.autoscaling.external:
        return clamp(external.get(role, spec.replicas), spec.min_replicas, spec.max_replicas)
    return _autoscaled(svc, status, role) if svc.autoscaling.enabled else spec.replicas


def desired_replicas(svc: ServiceSpec, status: dict[str, Any] | None,
                     external: dict[str, int] | None = None) -> RoleReplicas:
    """Per role: the RoleScaler's count for a role listed in autoscaling.external, the built-in
    autoscaler's for the others when it is on, else spec.replicas; then the P:D ratio, moving
    the roles the operator drives before an externally driven one."""
    auto = svc.autoscaling
    if not auto.enabled and not auto.external:
        return RoleReplicas(svc.prefill.replicas, svc.decode.replicas, svc.router.replicas)
    p, d = (_count(svc, status or {}, external or {}, role) for role in names.WORKER_ROLES)

    def span(role: str, count: int, pin: bool) -> tuple[int, int]:
        spec = svc.role(role)
        return (count, count) if pin and role in auto.external else (spec.min_replicas, spec.max_replicas)

    for pin in (True, False):
        pair = nearest_feasible(p, d, span(names.PREFILL, p, pin), span(names.DECODE, d, pin),
                                auto.ratio_min, auto.ratio_max)
        if pair is not None:
            return RoleReplicas(pair[0], pair[1], svc.router.replicas)
    return RoleReplicas(p, d, svc.router.replicas)


def desired_children(svc: ServiceSpec, replicas: RoleReplicas, generation: str, policy: OperatorPolicy,
                     new: Pair | None = None) -> list[dict[str, Any]]:
    """The current generation's children plus the role-wide ones. `new`: the current generation's
    (prefill, decode) pods while a rollout is under way (rollout/step.py), else the full counts."""
    new = new or (replicas.prefill, replicas.decode)
    children: list[dict[str, Any]] = [engine_configmap(svc, generation), *router_rbac(svc)]
    children += [headless_service(svc, role) for role in names.WORKER_ROLES]
    children += [generation_prefill_service(svc, generation), router_service(svc), kv_network_policy(svc, policy)]
    children += [disruption_budget(svc, role, replicas.of(role)) for role in names.ROLES]
    children += [role_scaler(svc, role) for role in names.WORKER_ROLES]
    children += [worker_deployment(svc, names.PREFILL, new[0], generation),
                 worker_deployment(svc, names.DECODE, new[1], generation)]
    children.append(router_deployment(svc, replicas.router))
    children += gateway_children(svc)
    if not policy.allow_host_access:  # after the template merge: no override keeps a privilege (security/harden.py)
        children = [harden_deployment(c) if c["kind"] == "Deployment" else c for c in children]
    order = {kind: pos for pos, kind in enumerate(CHILD_KINDS)}
    return sorted(children, key=lambda c: order[(c["apiVersion"], c["kind"])])


def reconcile(cr: dict[str, Any], policy: OperatorPolicy | None = None) -> list[dict[str, Any]]:
    """The manifests the operator applies for this CR, with no rollout under way. Raises
    SpecError for an invalid spec or one the operator's policy forbids."""
    policy = policy or OperatorPolicy()
    svc = parse_service(cr)
    refused = policy_problems(svc, policy)
    if refused:
        raise SpecError(refused)
    return desired_children(svc, desired_replicas(svc, cr.get("status")), generation_of(svc), policy)
