"""Pieces shared by the worker and router Deployments: probes, env, pod spec, the Deployment envelope."""

from __future__ import annotations

from typing import Any

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.child_meta import child_meta
from tandem.operator.render.template_merge import merge
from tandem.operator.spec.sections import RoleSpec
from tandem.operator.spec.service_spec import ServiceSpec


def http_probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": contract.HTTP_PORT_NAME},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def downward_env() -> list[dict[str, Any]]:
    return contract.downward_env()


def drain_command(timeout_s: int, admin_port: int = contract.ADMIN_PORT) -> list[str]:
    # The runtime image has python but no curl; POST /drain blocks until in-flight requests finish.
    # It goes to the admin listener (127.0.0.1 only): the serving port refuses admin routes without
    # the admin key, since behind a mesh sidecar every caller there looks like loopback.
    script = (
        "import urllib.request as u;"
        f"u.urlopen(u.Request('http://127.0.0.1:{admin_port}{names.DRAIN_PATH}', method='POST'),"
        f" timeout={max(timeout_s, 1)})"
    )
    return ["python3", "-c", script]


# Requests for what the user left unset: a pod with none is BestEffort, the first evicted under
# node pressure, and a model server must not be. A limit alone already implies a request.
ROUTER_REQUESTS = {"cpu": "250m", "memory": "256Mi"}


def worker_requests(tp_size: int) -> dict[str, str]:
    """cpu 2 / memory 8Gi at tp 1, plus one core and 4Gi per further rank: each TP rank is its
    own process, with a CPU thread driving its GPU, its own CUDA context and torch, and its
    weight shard passing through host memory while it loads. Requests only, no limits: a node
    with more to spare lets a pod use it."""
    return {"cpu": str(1 + tp_size), "memory": f"{4 + 4 * tp_size}Gi"}


def with_requests(resources: dict[str, Any], defaults: dict[str, str]) -> dict[str, Any]:
    out = {key: dict(value) for key, value in resources.items() if isinstance(value, dict)}
    requests, limits = out.get("requests") or {}, out.get("limits") or {}
    missing = {k: v for k, v in defaults.items() if k not in requests and k not in limits}
    if missing:
        out["requests"] = {**requests, **missing}
    return out


def pod_spec(svc: ServiceSpec, spec: RoleSpec, containers: list[dict[str, Any]],
             volumes: list[dict[str, Any]], grace_s: int, account: str | None = None) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "containers": containers,
        "terminationGracePeriodSeconds": grace_s,
        "enableServiceLinks": False,
        "topologySpreadConstraints": [{
            "maxSkew": 1,
            "topologyKey": "kubernetes.io/hostname",
            "whenUnsatisfiable": "ScheduleAnyway",
            "labelSelector": {"matchLabels": names.selector_labels(svc.name, spec.role)},
        }],
    }
    if volumes:
        pod["volumes"] = volumes
    if account:
        pod["serviceAccountName"] = account
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.tolerations]
    if svc.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in svc.image_pull_secrets]
    return pod


def deployment(svc: ServiceSpec, spec: RoleSpec, replicas: int, pod: dict[str, Any],
               annotations: dict[str, str], progress_deadline_s: int,
               generation: str | None = None) -> dict[str, Any]:
    """Wrap a pod spec into the role's Deployment, applying the role's template overrides.
    A worker Deployment belongs to one model generation and selects on it."""
    selector = names.selector_labels(svc.name, spec.role)
    name = names.role_name(svc.name, spec.role)
    if generation is not None:
        selector[names.LABEL_GENERATION] = generation
        name = names.generation_name(svc.name, spec.role, generation)
    rollout = svc.rollout_of(spec.role)
    template = merge(
        {"metadata": {"labels": names.standard_labels(svc.name, spec.role), "annotations": annotations},
         "spec": pod},
        spec.template,
    )
    # Overrides may add labels but must not change the ones the selector matches.
    template.setdefault("metadata", {}).setdefault("labels", {}).update(selector)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _deployment_meta(svc, name, spec.role, generation),
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": selector},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {
                    "maxSurge": rollout.max_surge,
                    "maxUnavailable": rollout.max_unavailable,
                },
            },
            "revisionHistoryLimit": 5,
            "progressDeadlineSeconds": progress_deadline_s,
            "template": template,
        },
    }


def _deployment_meta(svc: ServiceSpec, name: str, role: str, generation: str | None) -> dict[str, Any]:
    meta = child_meta(svc, name, role)
    if generation is not None:
        meta["labels"][names.LABEL_GENERATION] = generation
    return meta
