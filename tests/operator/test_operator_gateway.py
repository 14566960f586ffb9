"""spec.gateway: the InferencePool (and HTTPRoute) the operator renders, checked against the upstream
CRDs' schemas and CEL rules; the router's Endpoint Picker port on its Deployment and Service; the
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
from tandem.operator.spec.service_spec import SpecError, parse_service
from tandem.operator.spec.unknown_fields import unknown_fields
from tandem.operator.sync import _apply_all

ROUTE = {"parentRef": {"name": "inference-gateway", "namespace": "gateways", "sectionName": "https"},
         "hostnames": ["llm.example.com", "*.models.example.com"]}
POOL_PATH = resource_path(names.INFERENCE_POOL_API_VERSION, "InferencePool", "default", "llama3-8b")
ROUTE_PATH = resource_path(names.HTTP_ROUTE_API_VERSION, "HTTPRoute", "default", "llama3-8b")


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
        "endpointPickerRef": {"kind": "Service", "name": "llama3-8b", "port": {"number": contract.EPP_PORT},
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
    port = next(p for p in service["spec"]["ports"] if p["port"] == 9100)
    assert port == {"name": "grpc-epp", "port": 9100, "targetPort": "grpc-epp", "protocol": "TCP",
                    "appProtocol": "http2"}
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
                                    "name": "llama3-8b"}]}],
    }
    bare = gateway_kinds(render(with_gateway(minimal_cr, {"httpRoute": {"parentRef": {"name": "gw"}}})))["HTTPRoute"]
    assert bare["spec"]["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "gw"}]
    assert "hostnames" not in bare["spec"]


def test_gateway_children_are_owned_labelled_and_applied_last(minimal_cr: dict[str, Any]) -> None:
    children = render(with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    assert [c["kind"] for c in children[-2:]] == ["InferencePool", "HTTPRoute"]  # after every Deployment
    uid = minimal_cr["metadata"]["uid"]
    for child in children[-2:]:
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
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_gateway_children_satisfy_the_upstream_crds(example_cr: dict[str, Any], variant: str) -> None:
    kids = gateway_kinds(render(with_gateway(example_cr, VARIANTS[variant])))
    assert_valid(kids["InferencePool"], INFERENCE_POOL_V1)
    if "httpRoute" in VARIANTS[variant]:
        assert_valid(kids["HTTPRoute"], HTTP_ROUTE_V1)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_router_deployment_and_service_stay_valid_kubernetes(minimal_cr: dict[str, Any], version: str) -> None:
    kids = by_kind(render(with_gateway(minimal_cr, {"httpRoute": ROUTE})))
    kube_validate(kids[("Deployment", "llama3-8b-router")], version)
    kube_validate(kids[("Service", "llama3-8b")], version)


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
    route["spec"]["rules"][0]["timeouts"] = {"request": "300s"}  # outside the copied cut: unknown here
    found = " | ".join(problems(route, HTTP_ROUTE_V1))
    assert "rules[0].timeouts: unknown field" in found
    del route["spec"]["rules"][0]["timeouts"]
    found = " | ".join(problems(route, HTTP_ROUTE_V1))
    assert "sectionName must be unique" in found and "must not contain '//'" in found


# --- the spec section --------------------------------------------------------------------------------

def test_parsed_section(minimal_cr: dict[str, Any]) -> None:
    assert parse_service(minimal_cr).gateway is None
    assert parse_service(with_gateway(minimal_cr, {"inferencePool": {"enabled": False}})).gateway is None
    gateway = parse_service(with_gateway(minimal_cr, {"httpRoute": ROUTE})).gateway
    assert gateway is not None and gateway.route is not None
    assert (gateway.epp_port, gateway.failure_mode) == (9002, "FailClose")
    assert (gateway.route.parent.name, gateway.route.parent.namespace) == ("inference-gateway", "gateways")
    assert gateway.route.hostnames == ("llm.example.com", "*.models.example.com")


BAD: list[tuple[Any, str]] = [
    ("yes", "spec.gateway must be a mapping"),
    ({"inferencePool": []}, "spec.gateway.inferencePool must be a mapping"),
    ({"inferencePool": {"enabled": "true"}}, "inferencePool.enabled must be true or false"),
    ({"inferencePool": {"eppPort": 0}}, "eppPort must be an integer in 1..65535"),
    ({"inferencePool": {"eppPort": 70_000}}, "eppPort must be an integer in 1..65535"),
    ({"inferencePool": {"eppPort": "9002"}}, "eppPort must be an integer in 1..65535"),
    ({"inferencePool": {"eppPort": 8000}}, "eppPort 8000 is the router's http port"),
    ({"inferencePool": {"eppPort": contract.ROUTER_ADMIN_PORT}}, "is the router's admin port"),
    ({"inferencePool": {"eppPort": 80}}, "eppPort 80 is spec.router.servicePort"),
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
    cond = condition(result.status, "GatewayConfigured")
    assert (cond["status"], cond["reason"]) == ("True", "Applied")
    assert "InferencePool llama3-8b and HTTPRoute llama3-8b" in cond["message"]
    cond = condition(run_sync(FakeApiServer(), minimal_cr).status, "GatewayConfigured")
    assert (cond["status"], cond["reason"]) == ("False", "Disabled")


def test_removing_the_route_then_the_section_prunes_them(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    run_sync(server, with_gateway(minimal_cr, {"httpRoute": ROUTE}))
    run_sync(server, with_gateway(minimal_cr, {}))
    assert POOL_PATH in server.objects and ROUTE_PATH not in server.objects
    result = run_sync(server, minimal_cr)
    assert POOL_PATH not in server.objects
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
    assert ROUTE_PATH in applied and len(applied) == 17 + 2  # every other child, the route, and the PD Secret


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
          ("httpRoute", "parentRef", "sectionName"), ("httpRoute", "hostnames")]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_sections_never_escape_sync(minimal_cr: dict[str, Any], data: Any) -> None:
    gateway = copy.deepcopy({"inferencePool": {"eppPort": 9002}, "httpRoute": ROUTE})
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

