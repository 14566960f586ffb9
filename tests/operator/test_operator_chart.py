"""The Helm chart, rendered and linted offline with helm-python-sdk, validated against Kubernetes schemas.

kubernetes-validate knows only built-in kinds: the kopf peering objects are checked against kopf's
CRD schema (crds/kopf-peering.yaml) with jsonschema, the prometheus-operator monitors by hand.
RBAC is in test_operator_rbac.py.
"""

from __future__ import annotations

import argparse
from typing import Any

import jsonschema
import pytest
import yaml
from operator_support import CHART_DIR, KUBE_VERSIONS, kube_validate
from operator_support import render_chart as render

from tandem.operator.cli import register
from tandem.operator.spec.crd import build_crds

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (operator-test)")

NAMESPACED = {"watch": {"allNamespaces": False, "namespaces": ["serving", "research"]}}
ALL_NAMESPACES = {"watch": {"allNamespaces": True}}
MONITORS = {"serviceMonitor": {"enabled": True, "interval": "15s", "labels": {"release": "prom"}},
            "podMonitor": {"enabled": True, "interval": "1m"}}
STANDALONE = {"leaderElection": {"enabled": False}}
NOT_BUILT_IN = {"ClusterKopfPeering", "KopfPeering", "ServiceMonitor", "PodMonitor"}
KEEP = "helm.sh/resource-policy"


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    (dep,) = of_kind(docs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    return c


def test_lint_has_no_errors_or_warnings() -> None:
    report = helm.lint(str(CHART_DIR), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", [None, ALL_NAMESPACES, NAMESPACED, {**NAMESPACED, **MONITORS},
                                    {**MONITORS, **STANDALONE}],
                         ids=["release-namespace", "all-namespaces", "two-namespaces", "namespaced-monitors",
                              "standalone-monitors"])
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_rendered_manifests_pass_strict_validation(chart: Any, values: Any, version: str) -> None:
    docs = render(chart, values)
    assert {d["kind"] for d in docs} >= {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding",
                                         "CustomResourceDefinition", "Service", "ValidatingAdmissionPolicy",
                                         "ValidatingAdmissionPolicyBinding"}
    for doc in docs:
        if doc["kind"] not in NOT_BUILT_IN:
            kube_validate(doc, version)


# --- CRDs -------------------------------------------------------------------------------------

def _without_keep(crd: dict[str, Any]) -> dict[str, Any]:
    meta = dict(crd["metadata"])
    annotations = {k: v for k, v in (meta.pop("annotations", None) or {}).items() if k != KEEP}
    return {**crd, "metadata": {**meta, **({"annotations": annotations} if annotations else {})}}


def test_chart_crds_are_the_operator_crds_and_kept_on_uninstall(chart: Any) -> None:
    rendered = of_kind(render(chart), "CustomResourceDefinition")
    assert all(crd["metadata"]["annotations"][KEEP] == "keep" for crd in rendered)
    assert [_without_keep(crd) for crd in rendered] == build_crds()
    assert [c["metadata"]["name"] for c in rendered] == ["inferenceservices.tandem.dev", "rolescalers.tandem.dev"]
    # The generated file itself, too: `tandem operator crd > charts/tandem/files/crds.yaml`.
    generated = (CHART_DIR / "files" / "crds.yaml").read_text()
    assert [d for d in yaml.safe_load_all(generated) if d] == build_crds()


def test_crds_install_false_renders_no_crd(chart: Any) -> None:
    assert of_kind(render(chart, {"crds": {"install": False}}), "CustomResourceDefinition") == []


def _peering_crds(chart: Any) -> dict[str, dict[str, Any]]:
    docs = [d for f in chart.crds for d in yaml.safe_load_all(f["data"]) if d]
    return {d["spec"]["names"]["kind"]: d for d in docs}


def test_crds_dir_holds_only_kopfs_peering_crds(chart: Any) -> None:
    crds = _peering_crds(chart)
    assert set(crds) == {"ClusterKopfPeering", "KopfPeering"}
    assert {c["spec"]["group"] for c in crds.values()} == {"kopf.dev"}
    assert crds["ClusterKopfPeering"]["spec"]["scope"] == "Cluster"
    assert crds["KopfPeering"]["spec"]["scope"] == "Namespaced"
    for crd in crds.values():
        for version in KUBE_VERSIONS:
            kube_validate(crd, version)


# --- leader election (kopf peering) -------------------------------------------------------------

def _run_args(c: dict[str, Any]) -> argparse.Namespace:
    """The container's command line, parsed by the operator's own CLI parser."""
    parser = argparse.ArgumentParser(prog="tandem")
    register(parser.add_subparsers(dest="command", required=True))
    assert c["command"][:1] == ["tandem"]
    return parser.parse_args([*c["command"][1:], *c["args"]])


@pytest.mark.parametrize("values", [None, ALL_NAMESPACES, NAMESPACED])
def test_peering_is_on_by_default_with_a_rolling_update(chart: Any, values: Any) -> None:
    docs = render(chart, values)
    (dep,) = of_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    args = _run_args(container(docs))
    assert args.peering == "tandem" and args.priority is None  # replicas rank by age (runner.py)
    schemas = {k: c["spec"]["versions"][0]["schema"]["openAPIV3Schema"] for k, c in _peering_crds(chart).items()}
    if values is ALL_NAMESPACES:
        (peering,) = of_kind(docs, "ClusterKopfPeering")
        assert "namespace" not in peering["metadata"] and of_kind(docs, "KopfPeering") == []
    else:
        peerings = of_kind(docs, "KopfPeering")
        expected = ["research", "serving"] if values is NAMESPACED else ["tandem-system"]
        assert sorted(p["metadata"]["namespace"] for p in peerings) == expected
        assert of_kind(docs, "ClusterKopfPeering") == []
        peering = peerings[0]
    assert peering["apiVersion"] == "kopf.dev/v1" and peering["metadata"]["name"] == "tandem"
    jsonschema.validate(peering, schemas[peering["kind"]])


def test_standalone_uses_recreate_and_no_peering(chart: Any) -> None:
    docs = render(chart, STANDALONE)
    (dep,) = of_kind(docs, "Deployment")
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert _run_args(container(docs)).peering is None
    assert of_kind(docs, "ClusterKopfPeering") == of_kind(docs, "KopfPeering") == []


def test_more_than_one_replica_forces_peering(chart: Any) -> None:
    docs = render(chart, {"replicaCount": 2, **STANDALONE})
    (dep,) = of_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2 and dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert _run_args(container(docs)).peering == "tandem"
    assert len(of_kind(docs, "KopfPeering")) == 1  # in the release namespace, the default watch


def test_operator_pod_is_non_root_with_read_only_root(chart: Any) -> None:
    docs = render(chart)
    (dep,) = of_kind(docs, "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    c = container(docs)
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["command"] == ["tandem", "operator", "run"] and "--all-namespaces" not in c["args"]
    assert _run_args(c).namespace == ["tandem-system"]  # namespaced by default: the release namespace
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAMESPACE"] == "metadata.namespace" and env["POD_ID"] == "metadata.name"


# --- policy flags -------------------------------------------------------------------------------

def test_policy_values_become_flags(chart: Any) -> None:
    default = _run_args(container(render(chart)))
    assert default.allow_host_access is False and default.http_from_namespace == []
    values = {"security": {"allowHostAccess": True}, "networkPolicy": {"httpFromNamespaces": ["monitoring", "ops"]}}
    args = _run_args(container(render(chart, values)))
    assert args.allow_host_access is True and args.http_from_namespace == ["monitoring", "ops"]


# --- metrics ------------------------------------------------------------------------------------

def test_metrics_port_and_service(chart: Any) -> None:
    docs = render(chart)
    c = container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["metrics"] == 8081 and _run_args(c).metrics_port == 8081
    (svc,) = of_kind(docs, "Service")
    (dep,) = of_kind(docs, "Deployment")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics", "protocol": "TCP"}]
    assert of_kind(docs, "ServiceMonitor") == of_kind(docs, "PodMonitor") == []


def test_metrics_port_zero_turns_metrics_off(chart: Any) -> None:
    docs = render(chart, {"operator": {"metricsPort": 0}, **MONITORS})
    c = container(docs)
    assert "metrics" not in {p["name"] for p in c["ports"]} and _run_args(c).metrics_port == 0
    assert of_kind(docs, "Service") == of_kind(docs, "ServiceMonitor") == of_kind(docs, "PodMonitor") == []


def _check_monitor(mon: dict[str, Any], endpoints_key: str, interval: str, pod_labels: dict[str, str]) -> None:
    """The fields prometheus-operator's monitoring.coreos.com/v1 schema requires or we rely on."""
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert mon["metadata"]["namespace"] == "tandem-system"
    spec = mon["spec"]
    assert set(spec) == {"selector", "namespaceSelector", endpoints_key}
    assert set(spec["selector"]) == {"matchLabels"} and spec["selector"]["matchLabels"].items() <= pod_labels.items()
    assert spec["namespaceSelector"] == {"matchNames": ["tandem-system"]}
    (endpoint,) = spec[endpoints_key]
    assert endpoint == {"port": "metrics", "path": "/metrics", "interval": interval}


def test_monitors_select_the_operator_metrics(chart: Any) -> None:
    docs = render(chart, MONITORS)
    (dep,) = of_kind(docs, "Deployment")
    (svc,) = of_kind(docs, "Service")
    (service_monitor,) = of_kind(docs, "ServiceMonitor")
    (pod_monitor,) = of_kind(docs, "PodMonitor")
    _check_monitor(service_monitor, "endpoints", "15s", svc["metadata"]["labels"])
    _check_monitor(pod_monitor, "podMetricsEndpoints", "1m", dep["spec"]["template"]["metadata"]["labels"])
    assert service_monitor["metadata"]["labels"]["release"] == "prom"


# --- values schema ------------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [
    {"image": {"repository": "x", "pullPolicy": "Sometimes"}},
    {"securityContext": {"readOnlyRootFilesystem": False, "allowPrivilegeEscalation": False}},
    {"podSecurityContext": {"runAsNonRoot": False}},
    {"watch": {"allNamespaces": False, "namespaces": ["Not_A_Namespace"]}},
    {"unknownKey": 1},
    {"replicaCount": 0},
    {"leaderElection": {"enabled": True, "name": "Not A Name"}},
    {"leaderElection": {"enable": True}},
    {"crds": {"install": "yes"}},
    {"operator": {"metricsPort": 80}},
    {"security": {"allowHostAccess": "true"}},
    {"security": {"restrictPodPatches": "yes"}},
    {"networkPolicy": {"httpFromNamespaces": ["Bad_NS"]}},
    {"serviceMonitor": {"enabled": True, "interval": "30 seconds"}},
    {"podMonitor": {"enabled": True, "scrapeEvery": "30s"}},
])
def test_values_schema_rejects_bad_values(chart: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


def test_values_schema_accepts_defaults_and_every_option(chart: Any) -> None:
    chart.validate_schema({})
    chart.validate_schema(NAMESPACED)
    chart.validate_schema({"replicaCount": 2, "leaderElection": {"enabled": True, "name": "tandem-a"},
                           "crds": {"install": False}, "operator": {"metricsPort": 0},
                           "security": {"allowHostAccess": True, "restrictPodPatches": False},
                           "networkPolicy": {"httpFromNamespaces": ["monitoring"]}, **MONITORS})


def test_namespaced_without_namespaces_watches_the_release_namespace(chart: Any) -> None:
    for values in (None, {"watch": {"allNamespaces": False, "namespaces": []}}):
        docs = render(chart, values)
        assert _run_args(container(docs)).namespace == ["tandem-system"]
        assert [(d["kind"], d["metadata"]["namespace"]) for d in docs if d["kind"] in ("Role", "RoleBinding")] == [
            ("Role", "tandem-system"), ("RoleBinding", "tandem-system")]
        assert [d["metadata"]["name"] for d in of_kind(docs, "ClusterRole")] == ["tandem-discovery"]
    all_ns = _run_args(container(render(chart, ALL_NAMESPACES)))
    assert all_ns.all_namespaces is True and all_ns.namespace == []
