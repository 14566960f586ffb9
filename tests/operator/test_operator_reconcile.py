"""render(cr): every child is a valid Kubernetes object, owned and labelled, and follows the worker
contract."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
import yaml
from operator_support import KUBE_VERSIONS, by_kind, container, kube_validate, render

from tandem import worker_contract as contract
from tandem.operator import names
from tandem.operator.reconcile import OPTIONAL_KINDS, desired_replicas, reconcile
from tandem.operator.render.gateway import gateway_children
from tandem.operator.scaling import role_scaler
from tandem.operator.spec.service_spec import SpecError, parse_service


@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_every_child_passes_strict_kubernetes_validation(example_cr: dict[str, Any], version: str) -> None:
    children = render(example_cr)
    # spec.gateway's children (render/gateway.py) come on top of the 17 every service has.
    assert len(children) == 17 + len(gateway_children(parse_service(example_cr)))
    for child in children:
        if child["kind"] == "RoleScaler":  # our own kind: checked against its CRD schema
            jsonschema.validate(child, role_scaler.SCHEMA)
        elif (child["apiVersion"], child["kind"]) in OPTIONAL_KINDS:
            continue  # GIE's and Gateway API's kinds: against their CRDs in test_operator_gateway.py
        else:
            kube_validate(child, version)


def test_children_are_owned_labelled_and_namespaced(example_cr: dict[str, Any]) -> None:
    meta = example_cr["metadata"]
    for child in render(example_cr):
        cmeta = child["metadata"]
        assert cmeta["namespace"] == meta["namespace"]
        (owner,) = cmeta["ownerReferences"]
        assert owner == {"apiVersion": "tandem.dev/v1alpha1", "kind": "InferenceService",
                         "name": meta["name"], "uid": meta["uid"], "controller": True,
                         "blockOwnerDeletion": True}
        labels = cmeta["labels"]
        assert labels[names.LABEL_INSTANCE] == meta["name"]
        assert labels[names.LABEL_NAME] == "tandem"
        assert labels[names.LABEL_MANAGED_BY] == "tandem-operator"
        assert labels[names.LABEL_PART_OF] == "tandem"


def test_reconcile_is_pure_and_idempotent(example_cr: dict[str, Any]) -> None:
    before = copy.deepcopy(example_cr)
    first = render(example_cr)
    assert render(example_cr) == first
    assert example_cr == before
    # Children survive a YAML round trip unchanged (what `render` prints is what gets applied).
    assert list(yaml.safe_load_all(yaml.safe_dump_all(first))) == first


def test_worker_contract(minimal_cr: dict[str, Any]) -> None:
    kids = by_kind(render(minimal_cr))
    prefill = kids[("Deployment", "llama3-8b-prefill")]
    decode = kids[("Deployment", "llama3-8b-decode")]
    c = container(prefill)
    assert c["command"] == [
        "tandem", "serve", "--role", "prefill", "--model", "/models/llama-3.1-8b-instruct",
        "--served-model-name", "meta-llama/Llama-3.1-8B-Instruct", "--host", "0.0.0.0", "--port", "8000",
        "--bootstrap-port", "8998", "--admin-port", "8001", "--config", "/etc/tandem/engine.yaml",
    ]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": 8000, "bootstrap": 8998, "kv": 17000}
    assert {p["name"] for p in container(decode)["ports"]} == {"http", "kv"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert container(decode)["readinessProbe"]["httpGet"] == {"path": "/health/ready", "port": "http"}
    drain = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert "/drain" in drain and "method='POST'" in drain and "timeout=120" in drain
    assert f"127.0.0.1:{contract.ADMIN_PORT}/drain" in drain  # the admin listener, never the serving port
    assert prefill["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 150
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert mounts["/etc/tandem"]["readOnly"] and mounts["/models"]["readOnly"]
    items = next(v for v in prefill["spec"]["template"]["spec"]["volumes"] if v["name"] == "engine-config")
    assert items["configMap"]["items"] == [{"key": "prefill.yaml", "path": "engine.yaml"}]
    assert prefill["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_router_contract_and_rbac(minimal_cr: dict[str, Any]) -> None:
    kids = by_kind(render(minimal_cr))
    router = kids[("Deployment", "llama3-8b-router")]
    c = container(router)
    assert c["command"] == [
        "tandem", "router", "--host", "0.0.0.0", "--port", "8000", "--admin-port", "8002",
        "--model-name", "meta-llama/Llama-3.1-8B-Instruct",
        "--prefill-selector", "app.kubernetes.io/name=tandem,app.kubernetes.io/instance=llama3-8b,"
                              "app.kubernetes.io/component=prefill",
        "--decode-selector", "app.kubernetes.io/name=tandem,app.kubernetes.io/instance=llama3-8b,"
                             "app.kubernetes.io/component=decode",
        "--namespace", "default",
    ]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "llama3-8b-router"
    assert c["securityContext"]["readOnlyRootFilesystem"] and c["securityContext"]["runAsNonRoot"]
    role = kids[("Role", "llama3-8b-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    binding = kids[("RoleBinding", "llama3-8b-router")]
    assert binding["subjects"][0]["name"] == "llama3-8b-router"
    service = kids[("Service", "llama3-8b")]
    assert service["spec"]["selector"][names.LABEL_COMPONENT] == "router"
    assert service["spec"]["ports"][0]["port"] == 80
    for role_name in names.WORKER_ROLES:
        headless = kids[("Service", f"llama3-8b-{role_name}")]
        assert headless["spec"]["clusterIP"] == "None"
    assert {name for kind, name in kids if kind == "PodDisruptionBudget"} == {
        "llama3-8b-prefill", "llama3-8b-decode", "llama3-8b-router"}


def test_network_policy_keeps_bootstrap_and_kv_internal(minimal_cr: dict[str, Any]) -> None:
    policy = by_kind(render(minimal_cr))[("NetworkPolicy", "llama3-8b-internal-kv")]
    internal, http = policy["spec"]["ingress"]
    workers = {"matchLabels": names.selector_labels("llama3-8b"), "matchExpressions": [
        {"key": names.LABEL_COMPONENT, "operator": "In", "values": ["prefill", "decode"]}]}
    # KV and bootstrap: prefill and decode pods of this service only (not its router, not others).
    assert internal["from"] == [{"podSelector": workers}]
    assert {"protocol": "TCP", "port": 8998} in internal["ports"]
    assert {"protocol": "TCP", "port": 17000, "endPort": 17063} in internal["ports"]
    assert policy["spec"]["podSelector"] == workers
    # HTTP: this service's router and workers; no namespace is named by default.
    (source,) = http["from"]
    assert source["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode", "router"]
    assert http["ports"] == [{"protocol": "TCP", "port": 8000}]


def test_network_policy_opens_http_to_named_namespaces_only(minimal_cr: dict[str, Any]) -> None:
    from tandem.operator.security.operator_policy import OperatorPolicy

    kids = by_kind(reconcile(minimal_cr, OperatorPolicy(http_from_namespaces=("tandem-system", "monitoring"))))
    http = kids[("NetworkPolicy", "llama3-8b-internal-kv")]["spec"]["ingress"][1]
    assert http["from"][1] == {"namespaceSelector": {"matchExpressions": [{
        "key": "kubernetes.io/metadata.name", "operator": "In", "values": ["monitoring", "tandem-system"]}]}}
    for version in KUBE_VERSIONS:
        kube_validate(kids[("NetworkPolicy", "llama3-8b-internal-kv")], version)


def test_engine_args_go_to_the_configmap_in_sglang_names() -> None:
    from operator_support import EXAMPLES_DIR, load_example

    cr = load_example(EXAMPLES_DIR / "inferenceservice-rdma.yaml")
    kids = by_kind(render(cr))
    data = kids[("ConfigMap", "llama3-70b-engine")]["data"]
    prefill, decode = yaml.safe_load(data["prefill.yaml"]), yaml.safe_load(data["decode.yaml"])
    assert prefill["page_size"] == 64 and prefill["chunked_prefill_size"] == 16384
    assert prefill["schedule_policy"] == "fcfs" and prefill["mem_fraction_static"] == 0.88
    assert prefill["cuda_graph_max_bs"] == 256
    assert (prefill["tp_size"], decode["tp_size"]) == (4, 2)
    assert prefill["kv_transfer"] == {"backend": "nixl", "port_base": 17000, "port_count": 128}
    env = {e["name"]: e.get("value") for e in container(kids[("Deployment", "llama3-70b-decode")])["env"]}
    assert env["UCX_TLS"] == "rc,cuda_copy,cuda_ipc,tcp" and env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"


def test_a_compatibility_change_starts_a_new_generation(minimal_cr: dict[str, Any]) -> None:
    """Engine args, image or model give new generation-named Deployments, ConfigMap and prefill
    Service (selecting on the label); a resources change keeps the generation."""
    def generation(cr: dict[str, Any]) -> str:
        kids = by_kind(render(cr))
        prefill, decode = kids[("Deployment", "llama3-8b-prefill")], kids[("Deployment", "llama3-8b-decode")]
        gen = prefill["metadata"]["labels"][names.LABEL_GENERATION]
        for dep in (prefill, decode):
            assert dep["spec"]["selector"]["matchLabels"][names.LABEL_GENERATION] == gen
            assert dep["spec"]["template"]["metadata"]["labels"][names.LABEL_GENERATION] == gen
        service = kids[("Service", f"llama3-8b-prefill-{gen}")]
        assert service["spec"]["selector"][names.LABEL_GENERATION] == gen
        peers = yaml.safe_load(kids[("ConfigMap", "llama3-8b-engine")]["data"]["decode.yaml"])["pd_prefill_peers"]
        assert peers.startswith(f"llama3-8b-prefill-{gen}.default.svc")
        return gen

    base = generation(minimal_cr)
    for field, value in (("engine", {"pageSize": 32}), ("image", "other:1")):
        changed = copy.deepcopy(minimal_cr)
        changed["spec"][field] = value
        assert generation(changed) != base
    same = copy.deepcopy(minimal_cr)
    same["spec"]["decode"] = {"resources": {"limits": {"memory": "64Gi"}}}
    assert generation(same) == base


def test_template_overrides_merge_by_name_and_keep_selector_labels(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["decode"] = {"template": {
        "metadata": {"labels": {names.LABEL_COMPONENT: "hijack", "team": "a"}},
        "spec": {"priorityClassName": "high", "containers": [
            {"name": "decode", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}},
            {"name": "sidecar", "image": "busybox"},
        ]},
    }}
    dep = by_kind(render(cr))[("Deployment", "llama3-8b-decode")]
    pod = dep["spec"]["template"]
    assert pod["metadata"]["labels"][names.LABEL_COMPONENT] == "decode"
    assert pod["metadata"]["labels"]["team"] == "a"
    assert pod["spec"]["priorityClassName"] == "high"
    main, sidecar = pod["spec"]["containers"]
    assert main["command"][:4] == ["tandem", "serve", "--role", "decode"]
    assert main["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert main["securityContext"]["allowPrivilegeEscalation"] is False
    assert sidecar == {"name": "sidecar", "image": "busybox"}
    for version in KUBE_VERSIONS:
        kube_validate(dep, version)


def test_cpu_example_keeps_zero_gpus_and_host_path() -> None:
    from operator_support import EXAMPLES_DIR, load_example

    kids = by_kind(render(load_example(EXAMPLES_DIR / "inferenceservice-cpu-hostpath.yaml")))
    dep = kids[("Deployment", "tiny-dev-prefill")]
    assert container(dep)["resources"]["limits"]["nvidia.com/gpu"] == 0
    model = next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "model")
    assert model["hostPath"] == {"path": "/srv/models/tiny-llama", "type": "Directory"}
    assert container(dep)["command"][5] == "/models"


INVALID: dict[str, tuple[dict[str, Any], str]] = {
    "uri reserved": ({"model": {"servedName": "m", "uri": "hf://org/m"}}, "reserved"),
    "two sources": ({"model": {"servedName": "m", "uri": "x", "hostPath": {"path": "/m"}}}, "exactly one"),
    "min above max": ({"decode": {"minReplicas": 5, "maxReplicas": 2}}, "exceeds maxReplicas"),
    "gpu below tp": ({"decode": {"tensorParallelSize": 4, "resources": {"limits": {"nvidia.com/gpu": 2}}}},
                     "below tensorParallelSize"),
    "infeasible ratio": ({"prefill": {"minReplicas": 4, "maxReplicas": 4},
                          "decode": {"minReplicas": 1, "maxReplicas": 1},
                          "autoscaling": {"enabled": True, "ratio": {"min": 0.5, "max": 2}}}, "P:D ratio"),
    "latency without slo": ({"autoscaling": {"enabled": True, "prefill": {"signal": "ttftP95"}}}, "spec.slo"),
    "ports overlap": ({"kvTransfer": {"portBase": 7990, "portCount": 20}}, "overlaps"),
    "unknown engine arg": ({"engine": {"pageSzie": 16}}, "unknown fields"),
    "quoted engine switch": ({"engine": {"deterministic": "false"}}, "deterministic must be true or false"),
    "both rollout zero": ({"rollout": {"maxSurge": 0, "maxUnavailable": 0}}, "cannot both be 0"),
}


@pytest.mark.parametrize("case", sorted(INVALID))
def test_invalid_specs_raise_clear_spec_errors(case: str, minimal_cr: dict[str, Any]) -> None:
    patch, fragment = INVALID[case]
    cr = copy.deepcopy(minimal_cr)
    cr["spec"].update(copy.deepcopy(patch))
    with pytest.raises(SpecError, match=fragment):
        render(cr)


def test_bad_name_and_missing_image_are_reported_together(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["metadata"]["name"] = "Bad_Name"
    del cr["spec"]["image"]
    with pytest.raises(SpecError) as err:
        render(cr)
    assert len(err.value.problems) == 2


def test_autoscaled_replicas_come_from_status_until_spec_changes(autoscaling_cr: dict[str, Any]) -> None:
    svc = parse_service(autoscaling_cr)
    assert desired_replicas(svc, {}).prefill == 2
    status = {"autoscaler": {"prefill": {"replicas": 5, "specReplicas": 2},
                             "decode": {"replicas": 4, "specReplicas": 2}}}
    assert (desired_replicas(svc, status).prefill, desired_replicas(svc, status).decode) == (5, 4)
    # kubectl scale / an edit of spec.decode.replicas restarts the autoscaler from the new value.
    edited = copy.deepcopy(autoscaling_cr)
    edited["spec"]["decode"]["replicas"] = 6
    got = desired_replicas(parse_service(edited), status)
    assert (got.prefill, got.decode) == (5, 6)
    # The ratio range [0.5, 2] is enforced on whatever counts result.
    lopsided = {"autoscaler": {"prefill": {"replicas": 8, "specReplicas": 2},
                               "decode": {"replicas": 1, "specReplicas": 2}}}
    got = desired_replicas(svc, lopsided)
    assert 0.5 <= got.prefill / got.decode <= 2.0
    dep = by_kind(render({**autoscaling_cr, "status": status}))[("Deployment", "qwen-chat-prefill")]
    assert dep["spec"]["replicas"] == 5


def test_without_autoscaling_spec_replicas_are_literal(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["decode"] = {"replicas": 3}
    cr["status"] = {"autoscaler": {"decode": {"replicas": 9, "specReplicas": 3}}}
    dep = by_kind(render(cr))[("Deployment", "llama3-8b-decode")]
    assert dep["spec"]["replicas"] == 3


def test_the_routers_prestop_drains_through_its_admin_listener(minimal_cr: dict[str, Any]) -> None:
    kids = by_kind(reconcile(minimal_cr))
    router = next(d for (kind, name), d in kids.items() if kind == "Deployment" and name.endswith("-router"))
    c = router["spec"]["template"]["spec"]["containers"][0]
    drain = " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
    assert f"127.0.0.1:{contract.ROUTER_ADMIN_PORT}/drain" in drain


def test_the_kv_cache_dtype_is_one_field_for_both_roles(minimal_cr) -> None:
    """spec.engine.kvCacheDtype reaches both roles' engine.yaml alike: they cannot store KV apart."""
    import copy

    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["engine"] = {"kvCacheDtype": "fp8_e4m3"}
    for role in ("prefill", "decode"):  # fp8 KV runs on CPU workers in this release
        cr["spec"].setdefault(role, {})["resources"] = {"limits": {"nvidia.com/gpu": 0}}
    data = next(c for (kind, _), c in by_kind(render(cr)).items() if kind == "ConfigMap")["data"]
    assert {yaml.safe_load(data[f"{role}.yaml"])["kv_cache_dtype"] for role in ("prefill", "decode")} == {"fp8_e4m3"}
