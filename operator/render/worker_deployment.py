"""The prefill and decode Deployments.

Readiness is `/health/ready`. On decode pods the worker answers 200 there only after
a KV-transfer handshake with at least one prefill pod succeeded, so a ready decode
pod proves a working P->D path; the operator's Ready condition builds on that.
"""

from __future__ import annotations

import math
from typing import Any

from kubernetes.utils import parse_quantity

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.render.engine_configmap import config_key
from tandem.operator.render.pod_common import (
    deployment,
    drain_command,
    http_probe,
    pod_spec,
    with_requests,
    worker_requests,
)
from tandem.operator.security.harden import restricted_security_context
from tandem.operator.security.secret_env import worker_secret_env
from tandem.operator.spec.sections import GPU, RoleSpec
from tandem.operator.spec.service_spec import ServiceSpec

# Time for the pod to leave Service endpoints and the router's pod list after preStop finishes.
GRACE_MARGIN_S = 30
STARTUP_PROBE_PERIOD_S = 10
SHM_SIZE_LIMIT = "16Gi"


def worker_command(svc: ServiceSpec, spec: RoleSpec) -> list[str]:
    return contract.worker_argv(contract.WorkerArgs(
        role=spec.role, model=svc.model.container_path, served_model_name=svc.model.served_name,
        host="0.0.0.0", port=names.HTTP_PORT, bootstrap_port=names.BOOTSTRAP_PORT,
        # Given, not derived: the preStop hook drains through this port (drain_command).
        admin_port=contract.ADMIN_PORT, config=contract.ENGINE_CONFIG_PATH, extra=tuple(spec.extra_args),
        tool_call_parser=svc.model.tool_call_parser, reasoning_parser=svc.model.reasoning_parser,
    ))


def worker_resources(spec: RoleSpec) -> dict[str, Any]:
    """The role's resources, with tensorParallelSize GPUs (one per rank) unless the user set a GPU
    limit, and CPU/memory requests for the ranks where the user set neither request nor limit."""
    resources = with_requests(spec.resources, worker_requests(spec.tensor_parallel_size))
    limits = resources.setdefault("limits", {})
    limits.setdefault(GPU, spec.tensor_parallel_size)
    requests = resources.get("requests")
    if requests is not None and GPU in requests:
        requests[GPU] = limits[GPU]  # extended resources require requests == limits
    if spec.host_cache_gib > 0:  # the KV host tier is pod memory on top of what the model needs
        for part in (resources.get("requests") or {}, limits):
            try:
                part["memory"] = str(int(parse_quantity(part["memory"]) + int(spec.host_cache_gib * 2**30)))
            except (KeyError, ValueError):  # unset, or not a quantity: the API server says which
                pass
    return resources


def worker_env(svc: ServiceSpec, role: str) -> list[dict[str, Any]]:
    kv = contract.KvTransfer(backend=svc.kv.backend, port_base=svc.kv.port_base, port_count=svc.kv.port_count)
    # The root filesystem is read-only: the CPU kernel build cache, the Triton / HF caches and
    # Python's own temp files all go under the /tmp emptyDir.
    writable = [{"name": "HOME", "value": "/tmp"}, {"name": "TANDEM_HOME", "value": "/tmp/tandem"},
                {"name": "XDG_CACHE_HOME", "value": "/tmp/.cache"}]
    secrets = worker_secret_env(svc.name, svc.api_key)  # from Secrets, never on argv (security/secret_env.py)
    termination = [contract.termination_message_env()]  # where terminationMessagePath reads a start-up error
    return contract.worker_env(role, kv, svc.kv.transports, svc.kv.devices) + writable + secrets + termination


def worker_ports(role: str, svc: ServiceSpec) -> list[dict[str, Any]]:
    return [{"name": name, "containerPort": port, "protocol": "TCP"}
            for name, port in contract.worker_ports(role, svc.kv.port_base)]


def worker_volumes(svc: ServiceSpec, role: str, generation: str) -> list[dict[str, Any]]:
    if svc.model.pvc_claim:
        claim = {"claimName": svc.model.pvc_claim, "readOnly": True}
        model: dict[str, Any] = {"persistentVolumeClaim": claim}
    else:
        model = {"hostPath": {"path": svc.model.host_path, "type": "Directory"}}
    return [
        {"name": "model", **model},
        {"name": "engine-config", "configMap": {
            "name": names.engine_config_name(svc.name, generation),
            "items": [{"key": config_key(role), "path": names.ENGINE_CONFIG_FILE}],
        }},
        # NCCL (between the TP ranks of a pod), torch.distributed and the KV transfer engine use
        # shared memory; the container default is 64 MiB. Memory-backed, so it counts as the pod's memory.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": SHM_SIZE_LIMIT}},
        {"name": "tmp", "emptyDir": {"sizeLimit": "8Gi"}},
    ]


def worker_container(svc: ServiceSpec, spec: RoleSpec) -> dict[str, Any]:
    return {
        "name": spec.role,
        "image": spec.image,
        "imagePullPolicy": svc.image_pull_policy,
        "command": worker_command(svc, spec),
        "ports": worker_ports(spec.role, svc),
        "env": worker_env(svc, spec.role),
        "resources": worker_resources(spec),
        "startupProbe": http_probe(
            names.HEALTH_PATH, STARTUP_PROBE_PERIOD_S, 5,
            max(1, math.ceil(spec.startup_timeout_s / STARTUP_PROBE_PERIOD_S))),
        "livenessProbe": http_probe(names.HEALTH_PATH, 10, 5, 3),
        "readinessProbe": http_probe(names.READY_PATH, 5, 3, 2),
        "lifecycle": {"preStop": {"exec": {"command": drain_command(spec.drain_timeout_s)}}},
        "volumeMounts": [
            {"name": "model", "mountPath": names.MODEL_MOUNT, "readOnly": True},
            {"name": "engine-config", "mountPath": names.ENGINE_CONFIG_DIR, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
        "securityContext": restricted_security_context(),
        # The worker writes a fatal start-up error here (tandem/server/start_failure.py); a crash
        # that left none (a segfault, an OOM kill) shows its log's tail instead. Either reaches
        # the CR's WorkersFailing condition (operator/worker_failures.py).
        "terminationMessagePath": contract.TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def worker_deployment(svc: ServiceSpec, role: str, replicas: int, generation: str) -> dict[str, Any]:
    """One generation's Deployment of a worker role (rollout/step.py steps the generations)."""
    spec = svc.role(role)
    pod = pod_spec(
        svc, spec, [worker_container(svc, spec)], worker_volumes(svc, role, generation),
        grace_s=spec.drain_timeout_s + GRACE_MARGIN_S,
    )
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(names.HTTP_PORT),
        "prometheus.io/path": names.METRICS_PATH,
    }
    return deployment(svc, spec, replicas, pod, annotations, progress_deadline_s=spec.startup_timeout_s + 300,
                      generation=generation)
