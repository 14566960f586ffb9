"""The gateway children (spec.gateway): an InferencePool over the serving pods with the router as its
Endpoint Picker, and optionally an HTTPRoute from a Gateway to that pool.

  client -> Gateway --ext-proc (gRPC)--> the router's EPP listener (Service <cr>, port eppPort)
                    <-- "decode pod X", plus a request header naming the prefill pod X pairs with
            Gateway -> decode pod X, port 8000 (the pool's targetPort), which has that pod prefill

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
            # No generation label: every generation's decode pods serve while a rollout drains the old one.
            "selector": {"matchLabels": names.selector_labels(svc.name, SERVING_ROLE)},
            "targetPorts": [{"number": names.HTTP_PORT}],
            "appProtocol": "http",  # the workers' OpenAI API is HTTP/1.1 (GIE's default, stated)
            "endpointPickerRef": {
                # group left out: the CRD defaults it to "", the core group a Service is in.
                "kind": "Service",
                "name": names.router_service_name(svc.name),
                "port": {"number": gateway.epp_port},  # the Service's port, which the router Service maps 1:1
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
    }]
    return {
        "apiVersion": names.HTTP_ROUTE_API_VERSION,
        "kind": "HTTPRoute",
        "metadata": child_meta(svc, names.http_route_name(svc.name)),
        "spec": spec,
    }


def gateway_children(svc: ServiceSpec) -> list[dict[str, Any]]:
    """The InferencePool, and the HTTPRoute when spec.gateway.httpRoute is set; none without spec.gateway."""
    if svc.gateway is None:
        return []
    children = [inference_pool(svc, svc.gateway)]
    if svc.gateway.route is not None:
        children.append(http_route(svc, svc.gateway.route))
    return children
