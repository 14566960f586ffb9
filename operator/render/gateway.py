"""The gateway children (spec.gateway): an InferencePool over the serving pods with the router as its
Endpoint Picker, the Endpoint Picker's Service, optionally an HTTPRoute from a Gateway to that pool,
and a NetworkPolicy that lets the gateway's proxy reach the serving pods.

  client -> Gateway --ext-proc (gRPC)--> the router's EPP listener (Service <cr>-epp, port eppPort)
                    <-- "decode pod X", plus a request header naming the prefill pod X pairs with
            Gateway -> decode pod X, port 8000 (the pool's targetPort), which has that pod prefill

The last hop goes from the gateway's proxy pods straight to the decode pod, not through the
router, so <cr>-internal-kv (render/network.py), which opens port 8000 to this service's own pods
only, would drop it: <cr>-gateway admits the proxy's namespaces to that port of the decode pods.

The pool selects the pods that take client traffic. This operator always runs prefill and
decode apart, so those are the decode pods of every model generation: the EPP pairs each with
a prefill pod of its own generation, from the router's --prefill-selector discovery.
Field shapes follow the CRDs: inference.networking.k8s.io/v1 of gateway-api-inference-extension
and gateway.networking.k8s.io/v1 (standard channel) of gateway-api.
"""

from __future__ import annotations

from typing import Any

from tandem.operator import names
from tandem.operator.child_meta import child_meta
from tandem.operator.render.network import namespaces_peer
from tandem.operator.render.router_children import epp_service
from tandem.operator.spec.gateway import GatewaySpec, HttpRouteSpec
from tandem.operator.spec.service_spec import ServiceSpec

SERVING_ROLE = names.DECODE
POOL_GROUP = names.INFERENCE_POOL_API_VERSION.split("/")[0]
GATEWAY_GROUP = names.HTTP_ROUTE_API_VERSION.split("/")[0]


def inference_pool(svc: ServiceSpec, gateway: GatewaySpec) -> dict[str, Any]:
    return {
        "apiVersion": names.INFERENCE_POOL_API_VERSION,
        "kind": "InferencePool",
        "metadata": child_meta(svc, names.inference_pool_name(svc.name)),
        "spec": {
            "selector": {"matchLabels": _serving_pods(svc)},
            "targetPorts": [{"number": names.HTTP_PORT}],
            "appProtocol": "http",  # the workers' OpenAI API is HTTP/1.1 (GIE's default, stated)
            "endpointPickerRef": {
                # group left out: the CRD defaults it to "", the core group a Service is in.
                "kind": "Service",
                "name": names.epp_service_name(svc.name),
                "port": {"number": gateway.epp_port},  # the Service's port, which the EPP Service maps 1:1
                "failureMode": gateway.failure_mode,
            },
        },
    }


def http_route(svc: ServiceSpec, route: HttpRouteSpec) -> dict[str, Any]:
    parent: dict[str, Any] = {"group": GATEWAY_GROUP, "kind": "Gateway", "name": route.parent.name}
    if route.parent.namespace is not None:
        parent["namespace"] = route.parent.namespace
    if route.parent.section_name is not None:
        parent["sectionName"] = route.parent.section_name
    spec: dict[str, Any] = {"parentRefs": [parent]}
    if route.hostnames:
        spec["hostnames"] = list(route.hostnames)
    spec["rules"] = [{
        "matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
        # No port: a pool's backendRef takes the pool's targetPorts.
        "backendRefs": [{"group": POOL_GROUP, "kind": "InferencePool", "name": names.inference_pool_name(svc.name)}],
        # The whole request, a streamed answer included; "0s" is the Gateway API's "no timeout".
        "timeouts": {"request": route.request_timeout},
    }]
    return {
        "apiVersion": names.HTTP_ROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": child_meta(svc, names.http_route_name(svc.name)),
        "spec": spec,
    }


def gateway_network_policy(svc: ServiceSpec, namespaces: tuple[str, ...]) -> dict[str, Any]:
    """Ingress to the pool's pods on the HTTP port from every pod of `namespaces`, where the gateway's
    proxy runs. Only that port: the bootstrap and KV ports stay this service's own (<cr>-internal-kv).
    NetworkPolicies add up, so this opens the port without loosening the other policy."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": child_meta(svc, names.gateway_network_policy_name(svc.name)),
        "spec": {
            "podSelector": {"matchLabels": _serving_pods(svc)},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [namespaces_peer(namespaces)],
                         "ports": [{"protocol": "TCP", "port": names.HTTP_PORT}]}],
        },
    }


def _serving_pods(svc: ServiceSpec) -> dict[str, str]:
    # No generation label: every generation's decode pods serve while a rollout drains the old one.
    return names.selector_labels(svc.name, SERVING_ROLE)


def gateway_children(svc: ServiceSpec) -> list[dict[str, Any]]:
    """What spec.gateway adds: the InferencePool and its Endpoint Picker's Service; the HTTPRoute when
    httpRoute is set; the NetworkPolicy when any namespace is to be admitted. None without the section."""
    gateway = svc.gateway
    if gateway is None:
        return []
    children = [epp_service(svc, gateway), inference_pool(svc, gateway)]
    if gateway.route is not None:
        children.append(http_route(svc, gateway.route))
    if gateway.admitted_namespaces:
        children.append(gateway_network_policy(svc, gateway.admitted_namespaces))
    return children
