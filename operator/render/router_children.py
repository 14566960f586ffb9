"""The router: its Deployment, the client-facing Service, the Endpoint Picker's Service (spec.gateway),
and the RBAC it needs to discover worker pods."""

from __future__ import annotations

from typing import Any

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.child_meta import child_meta
from tandem.operator.render.pod_common import (
    ROUTER_REQUESTS,
    deployment,
    downward_env,
    drain_command,
    http_probe,
    pod_spec,
    with_requests,
)
from tandem.operator.security.harden import restricted_security_context
from tandem.operator.security.secret_env import router_secret_env
from tandem.operator.spec.gateway import GatewaySpec
from tandem.operator.spec.service_spec import ServiceSpec

ROUTER_DRAIN_S = 30


def router_command(svc: ServiceSpec) -> list[str]:
    return contract.router_argv(contract.RouterArgs(
        host="0.0.0.0", port=names.HTTP_PORT, namespace=svc.namespace,
        admin_port=contract.ROUTER_ADMIN_PORT,  # given, not derived: the preStop hook drains through it
        # Given, not learnt from the first worker: a router that starts with a role at zero pods
        # (scale from zero) must still answer /v1/models and check the model clients ask for.
        model_name=svc.model.served_name,
        prefill_selector=names.selector_string(names.selector_labels(svc.name, names.PREFILL)),
        decode_selector=names.selector_string(names.selector_labels(svc.name, names.DECODE)),
        # The Endpoint Picker listener, only with spec.gateway (extraArgs may not set it: sections.py).
        extra=(*_epp_args(svc), *svc.router.extra_args),
    ))


def _epp_args(svc: ServiceSpec) -> tuple[str, ...]:
    return ("--epp-port", str(svc.gateway.epp_port)) if svc.gateway is not None else ()


def _epp_port(svc: ServiceSpec) -> list[dict[str, Any]]:
    """The EPP's container port, for the EPP Service's targetPort."""
    if svc.gateway is None:
        return []
    return [{"name": names.EPP_PORT_NAME, "containerPort": svc.gateway.epp_port, "protocol": "TCP"}]


def router_deployment(svc: ServiceSpec, replicas: int) -> dict[str, Any]:
    spec = svc.router
    container = {
        "name": names.ROUTER,
        "image": spec.image,
        "imagePullPolicy": svc.image_pull_policy,
        "command": router_command(svc),
        "ports": [{"name": "http", "containerPort": names.HTTP_PORT, "protocol": "TCP"}, *_epp_port(svc)],
        "env": downward_env() + router_secret_env(svc.api_key),
        "resources": with_requests(spec.resources, ROUTER_REQUESTS),
        "livenessProbe": http_probe(names.HEALTH_PATH, 10, 3, 3),
        "readinessProbe": http_probe(names.READY_PATH, 5, 3, 2),
        "lifecycle": {"preStop": {"exec": {"command": drain_command(ROUTER_DRAIN_S, contract.ROUTER_ADMIN_PORT)}}},
        "securityContext": restricted_security_context(),
        # The root filesystem is read-only; Python and the HTTP server still want a /tmp.
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}],
    }
    pod = pod_spec(svc, spec, [container], [{"name": "tmp", "emptyDir": {}}], grace_s=ROUTER_DRAIN_S + 15,
                   account=names.router_account_name(svc.name))
    annotations = {"prometheus.io/scrape": "true", "prometheus.io/port": str(names.HTTP_PORT)}
    return deployment(svc, spec, replicas, pod, annotations, progress_deadline_s=600)


def router_service(svc: ServiceSpec) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(svc, names.router_service_name(svc.name), names.ROUTER),
        "spec": {
            "type": svc.router.service_type,
            "selector": names.selector_labels(svc.name, names.ROUTER),
            "ports": [{"name": "http", "port": svc.router.service_port, "targetPort": "http", "protocol": "TCP"}],
        },
    }


def epp_service(svc: ServiceSpec, gateway: GatewaySpec) -> dict[str, Any]:
    """The router's Endpoint Picker, the InferencePool's endpointPickerRef. A Service of its own, and
    always ClusterIP: on the client-facing Service, a LoadBalancer or NodePort router.serviceType would
    put the ext-proc listener outside the cluster, and only the gateway's proxy, inside, talks to it."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": child_meta(svc, names.epp_service_name(svc.name), names.ROUTER),
        "spec": {
            "type": "ClusterIP",
            "selector": names.selector_labels(svc.name, names.ROUTER),
            # ext-proc is gRPC, so HTTP/2 in clear text. "http2" is what GIE's own conformance EPP
            # Services declare, so every conformant gateway reads it; the port name's "grpc-" prefix
            # says the same to meshes that go by names (Istio).
            "ports": [{"name": names.EPP_PORT_NAME, "port": gateway.epp_port, "targetPort": names.EPP_PORT_NAME,
                       "protocol": "TCP", "appProtocol": "http2"}],
        },
    }


def router_rbac(svc: ServiceSpec) -> list[dict[str, Any]]:
    """Read-only access to pods in its own namespace: all the router needs for discovery."""
    account = names.router_account_name(svc.name)
    return [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": child_meta(svc, account, names.ROUTER),
            "automountServiceAccountToken": True,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "Role",
            "metadata": child_meta(svc, account, names.ROUTER),
            "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "RoleBinding",
            "metadata": child_meta(svc, account, names.ROUTER),
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
            "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": svc.namespace}],
        },
    ]
