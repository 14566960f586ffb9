"""Status from observed children: per-role counts, conditions, URL and SLO attainment. Pure.

Decode pods turn ready only after a KV handshake with a prefill pod (render/worker_deployment.py), so
`Ready` = prefill, decode and router each have a ready pod, and no decode metrics say
the handshake is down: a real prefill -> decode path exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.operator import names
from tandem.operator.conditions import Condition, merge_conditions
from tandem.operator.reconcile import RoleReplicas
from tandem.operator.spec.service_spec import ServiceSpec
from tandem.operator.worker_failures import STUCK_WAITING, WorkerFailure, workers_failing


@dataclass(frozen=True)
class RoleObserved:
    exists: bool = False
    replicas: int = 0
    ready: int = 0
    updated: int = 0
    current_generation: bool = False  # the Deployment controller has seen the latest spec


@dataclass(frozen=True)
class Measured:
    """What the autoscaler read from worker metrics this round (None: not available)."""

    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    handshake_ok: bool | None = None


@dataclass(frozen=True)
class ClusterView:
    """What sync saw beyond the role counts: the current generation, the old ones still holding
    pods, the worker Deployments, problems read off the pods (crash loops), failing worker
    containers with their termination messages (worker_failures.py), autoscalers that would
    fight the operator (role_scaler.hpa_conflicts), and child kinds the cluster has no CRD for."""

    generation: str = ""
    old: tuple[tuple[str, tuple[int, int]], ...] = ()
    deployments: tuple[dict[str, Any], ...] = ()
    pod_problems: tuple[str, ...] = ()
    conflicts: tuple[str, ...] = ()
    worker_failures: tuple[WorkerFailure, ...] = ()
    missing_kinds: tuple[tuple[str, str], ...] = ()  # (apiVersion, kind) of children with no CRD in the cluster


def pod_problems(pods: list[dict[str, Any]]) -> tuple[str, ...]:
    out = []
    for pod in pods:
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            reason = ((cs.get("state") or {}).get("waiting") or {}).get("reason")
            if reason in STUCK_WAITING:
                out.append(f"pod {pod['metadata']['name']}: {reason} ({cs.get('restartCount', 0)} restarts)")
    return tuple(sorted(out))


def _stuck(view: ClusterView, measured: Measured) -> tuple[str, str] | None:
    """(reason, message) when the rollout cannot finish by itself, else None."""
    for dep in view.deployments:
        for cond in (dep.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
                return "ProgressDeadlineExceeded", f"Deployment {dep['metadata']['name']}: {cond.get('message', '')}"
    if view.pod_problems:
        return "PodsFailing", "; ".join(view.pod_problems[:5])
    if measured.handshake_ok is False:
        return "KVHandshakeFailed", "decode pods report no successful KV handshake with a prefill pod"
    return None


@dataclass(frozen=True)
class ScalingReport:
    active: bool
    reason: str
    message: str


def observe_deployment(dep: dict[str, Any] | None) -> RoleObserved:
    if not dep:
        return RoleObserved()
    status = dep.get("status") or {}
    generation = (dep.get("metadata") or {}).get("generation")
    seen = status.get("observedGeneration")
    return RoleObserved(
        exists=True,
        replicas=int(status.get("replicas") or 0),
        ready=int(status.get("readyReplicas") or 0),
        updated=int(status.get("updatedReplicas") or 0),
        current_generation=generation is None or (seen is not None and seen >= generation),
    )


def _role_condition(role: str, obs: RoleObserved, desired: int) -> Condition:
    kind = f"{role.capitalize()}Ready"
    if not obs.exists:
        return Condition(kind, "False", "NotCreated", f"the {role} Deployment does not exist yet")
    if desired == 0:
        return Condition(kind, "False", "ScaledToZero", f"{role} has 0 desired pods")
    note = " (decode readiness includes a KV handshake with a prefill pod)" if role == names.DECODE else ""
    message = f"{obs.ready}/{desired} {role} pods ready{note}"
    return Condition(kind, "True" if obs.ready > 0 else "False",
                     "PodsReady" if obs.ready > 0 else "NoReadyPods", message)


def _ready_condition(roles: dict[str, Condition], measured: Measured) -> Condition:
    for role in names.ROLES:
        cond = roles[role]
        if cond.status != "True":
            return Condition("Ready", "False", f"{role.capitalize()}NotReady", cond.message)
    if measured.handshake_ok is False:
        return Condition("Ready", "False", "KVHandshakeFailed",
                         "decode pods report no successful KV handshake with any prefill pod")
    return Condition("Ready", "True", "PrefillDecodePathReady",
                     "router, prefill and decode are ready and a decode pod completed a KV handshake")


def _progress(svc: ServiceSpec, desired: RoleReplicas, observed: dict[str, RoleObserved]) -> list[str]:
    behind = []
    for role in names.ROLES:
        obs, want = observed[role], desired.of(role)
        if not obs.exists or not obs.current_generation or obs.updated < want or obs.replicas != want:
            behind.append(f"{role} {obs.updated}/{want} updated")
    return behind


def _progress_conditions(svc: ServiceSpec, desired: RoleReplicas, observed: dict[str, RoleObserved],
                         measured: Measured, view: ClusterView) -> tuple[Condition, Condition]:
    behind = _progress(svc, desired, observed)
    stuck = _stuck(view, measured)
    if view.conflicts:
        degraded = Condition("Degraded", "True", "ConflictingAutoscalers", "; ".join(view.conflicts))
        progressing = Condition("Progressing", "True" if behind else "False",
                                "RollingOut" if behind else "Stable", "; ".join(behind))
        return progressing, degraded
    if stuck is not None:
        reason, message = stuck
        return Condition("Progressing", "False", reason, message), Condition("Degraded", "True", reason, message)
    if view.old:
        drain = ", ".join(f"{gen or 'unlabelled'} ({p} prefill, {d} decode)" for gen, (p, d) in view.old)
        progressing = Condition("Progressing", "True", "RollingOutGeneration",
                                f"generation {view.generation}: {'; '.join(behind) or 'up'}; draining {drain}")
    elif behind:
        progressing = Condition("Progressing", "True", "RollingOut", "; ".join(behind))
    else:
        progressing = Condition("Progressing", "False", "Stable", "all roles are at their desired spec")
    short = [r for r in names.ROLES if observed[r].ready < desired.of(r)]
    if not behind and not view.old and short:
        return progressing, Condition("Degraded", "True", "ReplicasUnavailable",
                                      "fewer ready pods than desired: " + ", ".join(short))
    return progressing, Condition("Degraded", "False", "AsExpected", "")


# What to install for a missing CRD, and what to remove from the spec instead.
_CRD_ADVICE = {
    "InferencePool": ("the Gateway API Inference Extension's CRDs", "spec.gateway"),
    "HTTPRoute": ("the Gateway API CRDs", "spec.gateway.httpRoute"),
}


def gateway_condition(svc: ServiceSpec, missing_kinds: tuple[tuple[str, str], ...]) -> Condition:
    """GatewayConfigured: True once the InferencePool (and HTTPRoute) are applied. Whether a Gateway
    accepted them is the Gateway controller's to say, in the InferencePool's own status."""
    kind = "GatewayConfigured"
    if svc.gateway is None:
        return Condition(kind, "False", "Disabled", "spec.gateway is unset or its inferencePool is not enabled")
    if missing_kinds:
        gaps = [f"the cluster has no {api_version} {k} CRD; install {_CRD_ADVICE[k][0]} or remove {_CRD_ADVICE[k][1]}"
                for api_version, k in missing_kinds if k in _CRD_ADVICE]
        return Condition(kind, "False", "GatewayUnavailable", "; ".join(gaps))
    made = f"InferencePool {names.inference_pool_name(svc.name)}"
    if svc.gateway.route is not None:
        made += f" and HTTPRoute {names.http_route_name(svc.name)}"
    return Condition(kind, "True", "Applied", f"{made} applied; the router's Endpoint Picker is Service "
                                             f"{names.epp_service_name(svc.name)}, port {svc.gateway.epp_port}")


def build_conditions(svc: ServiceSpec, desired: RoleReplicas, observed: dict[str, RoleObserved],
                     measured: Measured, scaling: ScalingReport, view: ClusterView | None = None) -> list[Condition]:
    view = view or ClusterView()
    roles = {role: _role_condition(role, observed[role], desired.of(role)) for role in names.ROLES}
    progressing, degraded = _progress_conditions(svc, desired, observed, measured, view)
    return [
        roles[names.PREFILL], roles[names.DECODE], roles[names.ROUTER],
        _ready_condition(roles, measured), progressing, degraded, workers_failing(view.worker_failures),
        Condition("ScalingActive", "True" if scaling.active else "False", scaling.reason, scaling.message),
        gateway_condition(svc, view.missing_kinds),
    ]


def _slo_status(svc: ServiceSpec, measured: Measured, now: str) -> dict[str, Any]:
    slo: dict[str, Any] = {}
    for key, value, target in (("ttft", measured.ttft_p95_s, svc.slo.ttft_p95_s),
                               ("itl", measured.itl_p95_s, svc.slo.itl_p95_s)):
        if target is not None:
            slo[f"{key}TargetSeconds"] = target
        if value is not None:
            slo[f"{key}P95Seconds"] = round(value, 6)
            if target is not None:
                slo[f"{key}Attained"] = value <= target
    if measured.ttft_p95_s is not None or measured.itl_p95_s is not None:
        slo["measuredAt"] = now
    return slo


def build_status(svc: ServiceSpec, desired: RoleReplicas, observed: dict[str, RoleObserved],
                 measured: Measured, scaling: ScalingReport, previous: dict[str, Any],
                 now: str, view: ClusterView | None = None) -> dict[str, Any]:
    view = view or ClusterView()
    conditions = build_conditions(svc, desired, observed, measured, scaling, view)
    status: dict[str, Any] = {
        "url": names.service_url(svc.name, svc.namespace, svc.router.service_port),
        "observedGeneration": svc.generation,
        "conditions": merge_conditions(previous.get("conditions") or [], conditions, now, svc.generation),
    }
    for role in names.ROLES:
        obs = observed[role]
        status[role] = {
            "desiredReplicas": desired.of(role),
            "replicas": obs.replicas,
            "readyReplicas": obs.ready,
            "updatedReplicas": obs.updated,
            "selector": names.selector_string(names.selector_labels(svc.name, role)),
        }
    if view.generation:
        status["rollout"] = {"generation": view.generation, "oldGenerations": [
            {"generation": gen, "prefill": p, "decode": d} for gen, (p, d) in view.old]}
    slo = _slo_status(svc, measured, now)
    if slo:
        status["slo"] = slo
    return status


def invalid_status(previous: dict[str, Any], generation: int, reason: str, message: str,
                   now: str) -> dict[str, Any]:
    """Status for a spec the operator cannot act on: Degraded with the reason, children left as they are."""
    conditions = [
        Condition("Ready", "False", reason, message),
        Condition("Degraded", "True", reason, message),
        Condition("Progressing", "False", reason, "waiting for a corrected spec"),
    ]
    return {
        "observedGeneration": generation,
        "conditions": merge_conditions(previous.get("conditions") or [], conditions, now, generation),
    }
