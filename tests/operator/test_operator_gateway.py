"""spec.gateway: the InferencePool (and HTTPRoute) the operator renders, checked against the upstream
CRDs' schemas and CEL rules; the router's Endpoint Picker port on its Deployment and on a ClusterIP
Service of its own; the NetworkPolicy that admits the gateway's proxy to the decode pods; the
section's validation; and, through sync(), pruning and a cluster without the CRDs.
The operator run against kmock is in test_operator_e2e_kmock.py."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import jsonschema
import kopf
import pytest
from crd_validate import assert_valid, problems
from gateway_crd_schemas import HTTP_ROUTE_V1, INFERENCE_POOL_V1
from operator_fake_api import FakeApiServer, run_sync
from operator_support import KUBE_VERSIONS, by_kind, container, kube_validate, render

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.kubeapi import KubeApi, resource_path
from tandem.operator.reconcile import CHILD_KINDS, OPTIONAL_KINDS
from tandem.operator.scaling.autoscale_round import ServiceMemory
from tandem.operator.spec.crd import spec_schema
from tandem.operator.spec.field_checks import GATEWAY_DURATION
from tandem.operator.spec.service_spec import SpecError, parse_service
from tandem.operator.spec.spec_schema import ROUTE_REQUEST_TIMEOUT
from tandem.operator.spec.unknown_fields import unknown_fields
from tandem.operator.sync import _apply_all

ROUTE = {"parentRef": {"name": "inference-gateway", "namespace": "gateways", "sectionName": "https"},
         "hostnames": ["llm.example.com", "*.models.example.com"]}
POOL_PATH = resource_path(names.INFERENCE_POOL_API_VERSION, "InferencePool", "default", "llama3-8b")
ROUTE_PATH = resource_path(names.HTTP_ROUTE_API_VERSION, "HTTPRoute", "default", "llama3-8b")
EPP_PATH = resource_path("v1", "Service", "default", "llama3-8b-epp")
POLICY_PATH = resource_path("networking.k8s.io/v1", "NetworkPolicy", "default", "llama3-8b-gateway")


def with_gateway(cr: dict[str, Any], gateway: Any) -> dict[str, Any]:
    out = copy.deepcopy(cr)
    out["spec"]["gateway"] = gateway
    return out


def gateway_kinds(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children if c["kind"] in ("InferencePool", "HTTPRoute")}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status["conditions"] if c["type"] == kind)


# --- rendering -------------------------------------------------------------------------------------

def test_no_section_no_gateway_objects_and_no_epp(minimal_cr: dict[str, Any]) -> None:
    kids = by_kind(render(minimal_cr))
    assert not gateway_kinds(list(kids.values()))
    assert ("Service", "llama3-8b-epp") not in kids and ("NetworkPolicy", "llama3-8b-gateway") not in kids
    router = container(kids[("Deployment", "llama3-8b-router")])
    assert "--epp-port" not in router["command"]
    assert [p["name"] for p in router["ports"]] == ["http"]
    assert [p["name"] for p in kids[("Service", "llama3-8b")]["spec"]["ports"]] == ["http"]


def test_pool_selects_the_decode_pods_and_names_the_router_as_its_picker(minimal_cr: dict[str, Any]) -> None:
    children = render(with_gateway(minimal_cr, {}))
    pool = gateway_kinds(children)["InferencePool"]
    assert "HTTPRoute" not in gateway_kinds(children)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1" and pool["metadata"]["name"] == "llama3-8b"
    assert pool["spec"] == {
        "selector": {"matchLabels": {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "llama3-8b",
                                     "app.kubernetes.io/component": "decode"}},
        "targetPorts": [{"number": 8000}],
        "appProtocol": "http",
        "endpointPickerRef": {"kind": "Service", "name": "llama3-8b-epp", "port": {"number": contract.EPP_PORT},
                              "failureMode": "FailClose"},
    }
    # The selector picks the decode pods of the Deployment (any generation), never prefill or router pods.
    kids = by_kind(children)
    selector = pool["spec"]["selector"]["matchLabels"].items()
    for role in ("prefill", "decode", "router"):
        labels = kids[("Deployment", f"llama3-8b-{role}")]["spec"]["template"]["metadata"]["labels"]
        assert (selector <= labels.items()) == (role == "decode"), role


def test_the_picker_reference_reaches_the_routers_epp_listener(minimal_cr: dict[str, Any]) -> None:
    gateway = {"inferencePool": {"eppPort": 9100, "failureMode": "FailOpen"}}
    kids = by_kind(render(with_gateway(minimal_cr, gateway)))
    ref = kids[("InferencePool", "llama3-8b")]["spec"]["endpointPickerRef"]
    assert ref["port"] == {"number": 9100} and ref["failureMode"] == "FailOpen"
    service = kids[("Service", ref["name"])]
    assert ref["name"] == "llama3-8b-epp" and service["spec"]["type"] == "ClusterIP"
    assert service["spec"]["ports"] == [{"name": "grpc-epp", "port": 9100, "targetPort": "grpc-epp",
                                         "protocol": "TCP", "appProtocol": "http2"}]
    assert [p["name"] for p in kids[("Service", "llama3-8b")]["spec"]["ports"]] == ["http"]  # the client's only
    router = kids[("Deployment", "llama3-8b-router")]
    assert service["spec"]["selector"].items() <= router["spec"]["template"]["metadata"]["labels"].items()
    c = container(router)
    assert {"name": "grpc-epp", "containerPort": 9100, "protocol": "TCP"} in c["ports"]
    assert c["command"][c["command"].index("--epp-port") + 1] == "9100"


def test_router_extra_args_come_after_the_epp_flag(minimal_cr: dict[str, Any]) -> None:
    cr = with_gateway(minimal_cr, {})
    cr["spec"]["router"] = {"extraArgs": ["--policy", "round_robin"]}
    command = container(by_kind(render(cr))[("Deployment", "llama3-8b-router")])["command"]
    assert command[-4:] == ["--epp-port", "9002", "--policy", "round_robin"]


@pytest.mark.parametrize("service_type", ["LoadBalancer", "NodePort"])
def test_the_epp_port_stays_inside_the_cluster(minimal_cr: dict[str, Any], service_type: str) -> None:
    """A router exposed outside the cluster exposes its HTTP port there, never the ext-proc listener."""
    cr = with_gateway(minimal_cr, {})
    cr["spec"]["router"] = {"serviceType": service_type}
    kids = by_kind(render(cr))
    public, epp = kids[("Service", "llama3-8b")], kids[("Service", "llama3-8b-epp")]
    assert public["spec"]["type"] == service_type and [p["name"] for p in public["spec"]["ports"]] == ["http"]
    assert epp["spec"]["type"] == "ClusterIP" and [p["name"] for p in epp["spec"]["ports"]] == ["grpc-epp"]
    assert epp["spec"]["selector"] == public["spec"]["selector"]  # the same router pods
    assert kids[("InferencePool", "llama3-8b")]["spec"]["endpointPickerRef"]["name"] == "llama3-8b-epp"


def test_the_epp_port_may_share_the_client_services_port_number(minimal_cr: dict[str, Any]) -> None:
    """Two Services, so eppPort == router.servicePort clashes nowhere: not on a Service, not on the pod."""
    cr = with_gateway(minimal_cr, {"inferencePool": {"eppPort": 9100}})
    cr["spec"]["router"] = {"servicePort": 9100}
    kids = by_kind(render(cr))
    assert kids[("Service", "llama3-8b")]["spec"]["ports"][0]["port"] == 9100
    assert kids[("Service", "llama3-8b-epp")]["spec"]["ports"][0]["port"] == 9100
    assert [p["containerPort"] for p in container(kids[("Deployment", "llama3-8b-router")])["ports"]] == [8000, 9100]


def test_the_router_cli_reads_the_rendered_epp_port(minimal_cr: dict[str, Any]) -> None:
    """The operator's half of the contract against the router's own parser (tandem/router/cli.py)."""
    import argparse

    from tandem.router import cli as router_cli

    def epp_port(cr: dict[str, Any]) -> int:
        command = container(by_kind(render(cr))[("Deployment", "llama3-8b-router")])["command"]
        assert command[:2] == ["tandem", "router"]
        parser = argparse.ArgumentParser()
        router_cli.register(parser.add_subparsers())
        return router_cli._config(parser.parse_args(command[1:])).epp_port

    assert epp_port(minimal_cr) == 0  # off
    assert epp_port(with_gateway(minimal_cr, {"inferencePool": {"eppPort": 9100}})) == 9100


def test_route_sends_every_path_from_the_gateway_to_the_pool(minimal_cr: dict[str, Any]) -> None:
    route = gateway_kinds(render(with_gateway(minimal_cr, {"httpRoute": ROUTE})))["HTTPRoute"]
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["metadata"]["name"] == "llama3-8b"
    assert route["spec"] == {
        "parentRefs": [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "inference-gateway",
                        "namespace": "gateways", "sectionName": "https"}],
        "hostnames": ["llm.example.com", "*.models.example.com"],
        "rules": [{"matches": [{"path": {"type": "PathPrefix", "value": "/"}}],
                   "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                    "name": "llama3-8b"}],
                   "timeouts": {"request": "600s"}}],
    }
    bare = gateway_kinds(render(with_gateway(minimal_cr, {"httpRoute": {"parentRef": {"name": "gw"}}})))["HTTPRoute"]
    assert bare["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}]
    assert "hostnames" not in bare["spec"]


@pytest.mark.parametrize("timeout", ["20m", "1h30m", "0s", "500ms"])
def test_the_routes_request_timeout_is_the_specs(minimal_cr: dict[str, Any], timeout: str) -> None:
    gateway = {"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": timeout}}
    route = gateway_kinds(render(with_gateway(minimal_cr, gateway)))["HTTPRoute"]
    assert route["spec"]["rules"][0]["timeouts"] == {"request": timeout}


def test_the_default_timeout_is_the_routers_and_the_pattern_gateway_apis() -> None:
    """Kept honest: the default is the router's own request timeout (a generation through the gateway
    gets the budget one through the router gets), and the field's pattern is the upstream CRD's."""
    from tandem.router.config import RouterConfig

    assert ROUTE_REQUEST_TIMEOUT == f"{RouterConfig.request_timeout:.0f}s"
    timeouts = HTTP_ROUTE_V1["properties"]["spec"]["properties"]["rules"]["items"]["properties"]["timeouts"]
    assert GATEWAY_DURATION.pattern == timeouts["properties"]["request"]["pattern"]
    route = spec_schema()["properties"]["spec"]["properties"]["gateway"]["properties"]["httpRoute"]
    assert route["properties"]["requestTimeout"]["pattern"] == GATEWAY_DURATION.pattern


# --- the gateway's data path: NetworkPolicy -----------------------------------------------------------

def policy_of(cr: dict[str, Any]) -> dict[str, Any] | None:
    return by_kind(render(cr)).get(("NetworkPolicy", "llama3-8b-gateway"))


def test_the_gateways_namespace_reaches_the_decode_pods_http_port_only(minimal_cr: dict[str, Any]) -> None:
    policy = policy_of(with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    assert policy is not None
    assert policy["spec"] == {
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "llama3-8b",
                                        "app.kubernetes.io/component": "decode"}},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"namespaceSelector": {"matchExpressions": [{
            "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["gateways"]}]}}],
            "ports": [{"protocol": "TCP", "port": 8000}]}],
    }
    # The pods are the pool's: the gateway reaches every pod it may be sent to, and no other.
    kids = by_kind(render(with_gateway(minimal_cr, {"httpRoute": ROUTE})))
    assert policy["spec"]["podSelector"] == kids[("InferencePool", "llama3-8b")]["spec"]["selector"]
    # The instance's own policy is untouched: KV and bootstrap ports stay its own pods'.
    assert kids[("NetworkPolicy", "llama3-8b-internal-kv")] == by_kind(render(minimal_cr))[
        ("NetworkPolicy", "llama3-8b-internal-kv")]


def test_listed_namespaces_add_to_the_gateways(minimal_cr: dict[str, Any]) -> None:
    gateway = {"httpRoute": ROUTE, "httpFromNamespaces": ["envoy-gateway-system", "gateways", "envoy-gateway-system"]}
    policy = policy_of(with_gateway(minimal_cr, gateway))
    assert policy is not None
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == ["envoy-gateway-system",
                                                                                       "gateways"]
    only_listed = policy_of(with_gateway(minimal_cr, {"httpFromNamespaces": ["istio-ingress"]}))
    assert only_listed is not None
    assert only_listed["spec"]["ingress"][0]["from"][0]["namespaceSelector"]["matchExpressions"][0]["values"] == [
        "istio-ingress"]


@pytest.mark.parametrize("gateway", [
    {},
    {"httpRoute": {"parentRef": {"name": "gw"}}},  # a Gateway in this namespace: admitting it all is the user's call
    {"httpFromNamespaces": []},
    {"inferencePool": {"enabled": False}, "httpFromNamespaces": ["gateways"]},  # the section is off
], ids=["defaults", "same-namespace-gateway", "empty-list", "pool-off"])
def test_no_namespace_to_admit_no_policy(minimal_cr: dict[str, Any], gateway: dict[str, Any]) -> None:
    assert policy_of(with_gateway(minimal_cr, gateway)) is None


def test_gateway_children_are_owned_labelled_and_applied_last(minimal_cr: dict[str, Any]) -> None:
    children = render(with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    assert [c["kind"] for c in children[-2:]] == ["InferencePool", "HTTPRoute"]  # after every Deployment
    uid = minimal_cr["metadata"]["uid"]
    extra = [c for c in children if c["metadata"]["name"] in ("llama3-8b-epp", "llama3-8b-gateway")]
    assert sorted(c["kind"] for c in extra) == ["NetworkPolicy", "Service"]
    for child in children[-2:] + extra:
        (owner,) = child["metadata"]["ownerReferences"]
        assert owner["uid"] == uid and owner["controller"] and owner["blockOwnerDeletion"]
        assert child["metadata"]["namespace"] == minimal_cr["metadata"]["namespace"]
        assert child["metadata"]["labels"][names.LABEL_INSTANCE] == "llama3-8b"
    assert OPTIONAL_KINDS == set(CHILD_KINDS[-2:])


VARIANTS = {
    "defaults": {},
    "fail-open on another port": {"inferencePool": {"eppPort": 9100, "failureMode": "FailOpen"}},
    "route": {"httpRoute": ROUTE},
    "route without namespace or hostnames": {"httpRoute": {"parentRef": {"name": "gw"}}},
    "route without a timeout": {"httpRoute": {**ROUTE, "requestTimeout": "0s"}},
    "route with a long timeout": {"httpRoute": {**ROUTE, "requestTimeout": "99999h59m59s999ms"}},
    "namespaces": {"httpRoute": ROUTE, "httpFromNamespaces": [f"ns-{i}" for i in range(16)]},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gateway_children_satisfy_the_upstream_crds(example_cr: dict[str, Any], variant: str) -> None:
    kids = gateway_kinds(render(with_gateway(example_cr, VARIANTS[variant])))
    assert_valid(kids["InferencePool"], INFERENCE_POOL_V1)
    if "httpRoute" in VARIANTS[variant]:
        assert_valid(kids["HTTPRoute"], HTTP_ROUTE_V1)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_core_children_stay_valid_kubernetes(minimal_cr: dict[str, Any], version: str, variant: str) -> None:
    """The router's Deployment and Services, and the gateway's NetworkPolicy, against Kubernetes' own schema."""
    kids = by_kind(render(with_gateway(minimal_cr, VARIANTS[variant])))
    for key in [("Deployment", "llama3-8b-router"), ("Service", "llama3-8b"), ("Service", "llama3-8b-epp"),
                ("NetworkPolicy", "llama3-8b-gateway")]:
        if key in kids:
            kube_validate(kids[key], version)
    assert ("NetworkPolicy", "llama3-8b-gateway") in kids or "httpFromNamespaces" not in VARIANTS[variant]


def test_the_schema_checks_catch_what_they_should(minimal_cr: dict[str, Any]) -> None:
    """The validator itself: an invalid pool and route are refused, with the rule that refused them."""
    kids = gateway_kinds(render(with_gateway(minimal_cr, {"httpRoute": ROUTE})))
    pool, route = copy.deepcopy(kids["InferencePool"]), copy.deepcopy(kids["HTTPRoute"])
    pool["spec"]["targetPorts"] *= 2
    del pool["spec"]["endpointPickerRef"]["port"]
    pool["spec"]["selector"]["matchLabels"]["x"] = "not a label value!"
    found = " | ".join(problems(pool, INFERENCE_POOL_V1))
    assert "does not match" in found
    del pool["spec"]["selector"]["matchLabels"]["x"]
    found = " | ".join(problems(pool, INFERENCE_POOL_V1))
    assert "port number must be unique" in found and "port is required when kind is 'Service'" in found
    route["spec"]["parentRefs"] *= 2
    route["spec"]["rules"][0]["matches"][0]["path"]["value"] = "/v1//chat"
    route["spec"]["rules"][0]["filters"] = []  # outside the copied cut: unknown here
    route["spec"]["rules"][0]["timeouts"] = {"request": "10 minutes"}
    found = " | ".join(problems(route, HTTP_ROUTE_V1))
    assert "rules[0].filters: unknown field" in found and "'10 minutes' does not match" in found
    del route["spec"]["rules"][0]["filters"]
    route["spec"]["rules"][0]["timeouts"] = {"request": "60s", "backendRequest": "2m"}
    found = " | ".join(problems(route, HTTP_ROUTE_V1))
    assert "sectionName must be unique" in found and "must not contain '//'" in found
    assert "backendRequest timeout cannot be longer than request timeout" in found
    route["spec"]["rules"][0]["timeouts"] = {"request": "0s", "backendRequest": "2m"}  # 0s: no request timeout
    assert "backendRequest timeout" not in " | ".join(problems(route, HTTP_ROUTE_V1))


# --- the spec section --------------------------------------------------------------------------------

def test_parsed_section(minimal_cr: dict[str, Any]) -> None:
    assert parse_service(minimal_cr).gateway is None
    assert parse_service(with_gateway(minimal_cr, {"inferencePool": {"enabled": False}})).gateway is None
    gateway = parse_service(with_gateway(minimal_cr, {"httpRoute": ROUTE})).gateway
    assert gateway is not None and gateway.route is not None
    assert (gateway.epp_port, gateway.failure_mode) == (9002, "FailClose")
    assert (gateway.route.parent.name, gateway.route.parent.namespace) == ("inference-gateway", "gateways")
    assert gateway.route.hostnames == ("llm.example.com", "*.models.example.com")
    assert gateway.route.request_timeout == "600s"
    assert (gateway.http_from_namespaces, gateway.admitted_namespaces) == ((), ("gateways",))
    listed = parse_service(with_gateway(minimal_cr, {"httpFromNamespaces": ["b", "a"], "httpRoute": ROUTE})).gateway
    assert listed is not None and listed.admitted_namespaces == ("a", "b", "gateways")


BAD: list[tuple[Any, str]] = [
    ("yes", "spec.gateway must be a mapping"),
    ({"inferencePool": []}, "spec.gateway.inferencePool must be a mapping"),
    ({"inferencePool": {"enabled": "true"}}, "inferencePool.enabled must be true or false"),
    ({"inferencePool": {"eppPort": 0}}, "eppPort must be an integer in 1..65535"),
    ({"inferencePool": {"eppPort": 70_000}}, "eppPort must be an integer in 1..65535"),
    ({"inferencePool": {"eppPort": "9002"}}, "eppPort must be an integer in 1..65535"),
    ({"inferencePool": {"eppPort": 8000}}, "eppPort 8000 is the router's http port"),
    ({"inferencePool": {"eppPort": contract.ROUTER_ADMIN_PORT}}, "is the router's admin port"),
    ({"inferencePool": {"failureMode": "Sometimes"}}, "failureMode must be one of ['FailClose', 'FailOpen']"),
    ({"inferencePool": {"enabled": False}, "httpRoute": ROUTE}, "httpRoute needs spec.gateway.inferencePool.enabled"),
    ({"httpRoute": {}}, "httpRoute.parentRef {name[, namespace, sectionName]} is required"),
    ({"httpRoute": "gw"}, "httpRoute.parentRef {name[, namespace, sectionName]} is required"),
    ({"httpRoute": {"parentRef": {"name": "Bad_Gateway"}}}, "parentRef.name must be a DNS subdomain"),
    ({"httpRoute": {"parentRef": {"name": "g" * 254}}}, "at most 253 characters"),
    ({"httpRoute": {"parentRef": {"name": "gw", "namespace": "a.b"}}}, "parentRef.namespace must be a DNS label"),
    ({"httpRoute": {"parentRef": {"name": "gw", "namespace": "n" * 64}}}, "at most 63 characters"),
    ({"httpRoute": {"parentRef": {"name": "gw", "sectionName": "HTTPS"}}}, "parentRef.sectionName must be"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "hostnames": "a.example.com"}}, "hostnames must be a list"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "hostnames": [f"h{i}.example.com" for i in range(17)]}},
     "hostnames must be a list of at most 16"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "hostnames": ["https://llm.example.com"]}},
     "hostnames[0] must be a hostname"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "hostnames": [None]}}, "hostnames[0] must be a hostname"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": "10 minutes"}},
     "requestTimeout must be a Gateway API duration"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": "600"}}, "requestTimeout must be"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": "1.5h"}}, "requestTimeout must be"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": "100000s"}}, "requestTimeout must be"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": "1h1m1s1ms1h"}}, "requestTimeout must be"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": 600}}, "requestTimeout must be"),
    ({"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": ""}}, "requestTimeout must be"),
    ({"httpFromNamespaces": "gateways"}, "httpFromNamespaces must be a list of at most 16"),
    ({"httpFromNamespaces": [f"ns-{i}" for i in range(17)]}, "httpFromNamespaces must be a list of at most 16"),
    ({"httpFromNamespaces": ["Gateways"]}, "httpFromNamespaces[0] must be a DNS label"),
    ({"httpFromNamespaces": ["a", "b.c"]}, "httpFromNamespaces[1] must be a DNS label"),
    ({"httpFromNamespaces": [None]}, "httpFromNamespaces[0] must be a DNS label"),
    ({"inferencePool": {"enabled": False}, "httpFromNamespaces": ["x_y"]}, "httpFromNamespaces[0] must be"),
]


@pytest.mark.parametrize("gateway, says", BAD, ids=[f"{i}-{says.split()[0]}" for i, (_, says) in enumerate(BAD)])
def test_bad_sections_are_spec_errors_and_degraded(minimal_cr: dict[str, Any], gateway: Any, says: str) -> None:
    cr = with_gateway(minimal_cr, gateway)
    with pytest.raises(SpecError) as err:
        parse_service(cr)
    assert says in str(err.value)
    result = run_sync(FakeApiServer(), cr)
    assert isinstance(result.error, kopf.PermanentError)
    degraded = condition(result.status, "Degraded")
    assert degraded["reason"] == "InvalidSpec" and says in degraded["message"]


def test_the_router_extra_args_may_not_set_the_epp_port(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["router"] = {"extraArgs": ["--epp-port=9100"]}
    with pytest.raises(SpecError, match="may not set --epp-port.*spec.gateway.inferencePool.eppPort"):
        parse_service(cr)


def _schema_errors(cr: dict[str, Any]) -> list[str]:
    return [e.message for e in jsonschema.Draft4Validator(spec_schema()).iter_errors(cr)]


@pytest.mark.parametrize("gateway", [
    {"inferencePool": {"eppPort": 0}},
    {"inferencePool": {"failureMode": "Sometimes"}},
    {"httpRoute": {}},
    {"httpRoute": {"parentRef": {"name": "Bad_Gateway"}}},
    {"httpRoute": {"parentRef": {"name": "gw", "namespace": "a.b"}}},
    {"httpRoute": {"parentRef": {"name": "gw"}, "hostnames": [f"h{i}.example.com" for i in range(17)]}},
    {"httpRoute": {"parentRef": {"name": "gw"}, "hostnames": ["https://llm.example.com"]}},
    {"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": "10 minutes"}},
    {"httpRoute": {"parentRef": {"name": "gw"}, "requestTimeout": "100000s"}},
    {"httpFromNamespaces": [f"ns-{i}" for i in range(17)]},
    {"httpFromNamespaces": ["b.c"]},
], ids=lambda g: str(g)[:40])
def test_the_crd_schema_refuses_what_it_can(minimal_cr: dict[str, Any], gateway: Any) -> None:
    assert _schema_errors(with_gateway(minimal_cr, gateway))


def test_the_crd_schema_and_cel_accept_good_sections(minimal_cr: dict[str, Any]) -> None:
    for gateway in VARIANTS.values():
        assert problems(with_gateway(minimal_cr, gateway), spec_schema()) == []
    refused = problems(with_gateway(minimal_cr, {"inferencePool": {"enabled": False}, "httpRoute": ROUTE}),
                       spec_schema())
    assert len(refused) == 1 and refused[0].startswith(".spec.gateway: gateway.httpRoute needs gateway.inferencePool")


def test_a_typo_in_the_section_is_named(minimal_cr: dict[str, Any]) -> None:
    cr = with_gateway(minimal_cr, {"inferencePool": {"eppport": 9100}, "httpRoute": {"parentRef": {"name": "gw"},
                                                                                       "hostname": ["x.io"]}})
    assert unknown_fields(cr) == ["spec.gateway.inferencePool.eppport (did you mean eppPort?)",
                                  "spec.gateway.httpRoute.hostname (did you mean hostnames?)"]


# --- sync: apply, prune, a cluster without the CRDs ------------------------------------------------

def test_sync_applies_pool_and_route_and_says_so(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    result = run_sync(server, with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    assert result.error is None
    assert server.objects[POOL_PATH]["kind"] == "InferencePool" and server.objects[ROUTE_PATH]["kind"] == "HTTPRoute"
    assert EPP_PATH in server.objects and POLICY_PATH in server.objects
    cond = condition(result.status, "GatewayConfigured")
    assert (cond["status"], cond["reason"]) == ("True", "Applied")
    assert "InferencePool llama3-8b and HTTPRoute llama3-8b" in cond["message"]
    assert "Endpoint Picker is Service llama3-8b-epp, port 9002" in cond["message"]
    cond = condition(run_sync(FakeApiServer(), minimal_cr).status, "GatewayConfigured")
    assert (cond["status"], cond["reason"]) == ("False", "Disabled")


def test_removing_the_route_then_the_section_prunes_them(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    run_sync(server, with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    run_sync(server, with_gateway(minimal_cr, {}))
    # The route went, and with it the Gateway's namespace, the policy's only one.
    assert POOL_PATH in server.objects and EPP_PATH in server.objects
    assert ROUTE_PATH not in server.objects and POLICY_PATH not in server.objects
    result = run_sync(server, minimal_cr)
    assert POOL_PATH not in server.objects and EPP_PATH not in server.objects
    assert condition(result.status, "GatewayConfigured")["reason"] == "Disabled"
    service = server.objects[resource_path("v1", "Service", "default", "llama3-8b")]
    assert [p["name"] for p in service["spec"]["ports"]] == ["http"]


def test_a_cluster_without_the_gie_crd_reconciles_the_rest(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    server.fail["/apis/inference.networking.k8s.io/"] = (404, "NotFound")  # apply and list alike
    result = run_sync(server, with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    assert result.error is None
    cond = condition(result.status, "GatewayConfigured")
    assert (cond["status"], cond["reason"]) == ("False", "GatewayUnavailable")
    assert cond["message"] == ("the cluster has no inference.networking.k8s.io/v1 InferencePool CRD; install the "
                               "Gateway API Inference Extension's CRDs or remove spec.gateway")
    assert condition(result.status, "Degraded")["reason"] != "ApplyFailed"
    applied = {p for p in server.objects if "/inference.networking.k8s.io/" not in p}
    assert ROUTE_PATH in applied and EPP_PATH in applied and POLICY_PATH in applied
    # Every other child, the route, the EPP Service, the gateway's NetworkPolicy, and the PD Secret.
    assert len(applied) == 17 + 4


def test_a_cluster_without_gateway_api_keeps_the_pool(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    server.fail["/apis/gateway.networking.k8s.io/"] = (404, "NotFound")
    result = run_sync(server, with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    assert result.error is None and POOL_PATH in server.objects
    message = condition(result.status, "GatewayConfigured")["message"]
    assert "no gateway.networking.k8s.io/v1 HTTPRoute CRD" in message and "remove spec.gateway.httpRoute" in message
    assert "InferencePool" not in message


def test_a_service_without_the_section_is_untouched_by_missing_crds(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    for group in ("inference.networking.k8s.io", "gateway.networking.k8s.io"):
        server.fail[f"/apis/{group}/"] = (404, "NotFound")
    result = run_sync(server, minimal_cr)  # pruning lists both kinds: a 404 there means none to prune
    assert result.error is None and condition(result.status, "GatewayConfigured")["reason"] == "Disabled"


@pytest.mark.parametrize("code", [403, 422])
def test_other_refusals_of_the_pool_are_apply_failures(minimal_cr: dict[str, Any], code: int) -> None:
    server = FakeApiServer()
    server.fail["PATCH /apis/inference.networking.k8s.io/"] = (code, "Refused")
    result = run_sync(server, with_gateway(minimal_cr, {}))
    assert isinstance(result.error, kopf.PermanentError)
    assert condition(result.status, "Degraded")["reason"] == "ApplyFailed"


def test_a_core_kinds_404_is_still_an_error(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    server.fail["PATCH /apis/policy/"] = (404, "NotFound")
    assert condition(run_sync(server, minimal_cr).status, "Degraded")["reason"] == "ApplyFailed"


def test_missing_kinds_are_retried_on_every_pass_until_the_crds_appear(minimal_cr: dict[str, Any]) -> None:
    """An unchanged set of children is not re-applied within RESYNC_S, except the kinds whose CRD
    was missing: installing the CRDs heals the service on the next timer pass, with no edit."""
    children = render(with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    server, memory = FakeApiServer(), ServiceMemory()
    server.fail["/apis/inference.networking.k8s.io/"] = (404, "NotFound")

    async def apply(force: bool) -> list[str]:
        server.calls.clear()
        async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(server)) as client:
            await _apply_all(KubeApi(client), children, memory, force=force)
        return [path for method, path in server.calls if method == "PATCH"]

    assert len(asyncio.run(apply(force=True))) == len(children)
    assert memory.missing_kinds == ((names.INFERENCE_POOL_API_VERSION, "InferencePool"),)
    assert asyncio.run(apply(force=False)) == [POOL_PATH]  # only the missing kind is tried again
    del server.fail["/apis/inference.networking.k8s.io/"]
    assert asyncio.run(apply(force=False)) == [POOL_PATH]
    assert memory.missing_kinds == () and POOL_PATH in server.objects
    assert asyncio.run(apply(force=False)) == []  # healed: back to the plain resync


# --- bad input never escapes -------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_LEAF = st.one_of(st.none(), st.booleans(), st.integers(-(10**6), 10**6), st.text(max_size=12),
                  st.lists(st.one_of(st.none(), st.text(max_size=8)), max_size=3),
                  st.dictionaries(st.text(max_size=5), st.integers(), max_size=2))
_PATHS = [("inferencePool",), ("inferencePool", "enabled"), ("inferencePool", "eppPort"),
          ("inferencePool", "failureMode"), ("httpRoute",), ("httpRoute", "parentRef"),
          ("httpRoute", "parentRef", "name"), ("httpRoute", "parentRef", "namespace"),
          ("httpRoute", "parentRef", "sectionName"), ("httpRoute", "hostnames"), ("httpRoute", "requestTimeout"),
          ("httpFromNamespaces",)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_sections_never_escape_sync(minimal_cr: dict[str, Any], data: Any) -> None:
    gateway = copy.deepcopy({"inferencePool": {"eppPort": 9002}, "httpRoute": ROUTE, "httpFromNamespaces": ["a"]})
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(_PATHS))
        node = gateway
        try:
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = data.draw(_LEAF)
        except (KeyError, TypeError):
            pass  # an earlier draw replaced a parent
    result = run_sync(FakeApiServer(), with_gateway(minimal_cr, gateway))
    if result.error is not None:
        degraded = condition(result.status, "Degraded")
        assert degraded["status"] == "True" and degraded["message"]
    else:
        assert condition(result.status, "GatewayConfigured")["status"] in ("True", "False")

