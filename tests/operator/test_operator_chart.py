"""The Helm chart, rendered and linted offline with helm-python-sdk, validated against Kubernetes schemas."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from operator_support import CHART_DIR, KUBE_VERSIONS, kube_validate

from tandem.operator.crd import build_crd

helm = pytest.importorskip("helm_python", reason="pip install helm-python-sdk (operator-test)")

NAMESPACED = {"watch": {"allNamespaces": False, "namespaces": ["serving", "research"]}}


@pytest.fixture(scope="module")
def chart() -> Iterator[Any]:
    with helm.Chart.load(str(CHART_DIR)) as loaded:
        yield loaded


def render(chart: Any, values: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    files = chart.render(values, name="tandem", namespace="tandem-system")
    docs: list[dict[str, Any]] = []
    for path, text in sorted(files.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs


def test_lint_has_no_errors_or_warnings() -> None:
    report = helm.lint(str(CHART_DIR), strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("values", [None, NAMESPACED], ids=["all-namespaces", "two-namespaces"])
@pytest.mark.parametrize("version", KUBE_VERSIONS)
def test_rendered_manifests_pass_strict_validation(chart: Any, values: Any, version: str) -> None:
    docs = render(chart, values)
    assert {d["kind"] for d in docs} >= {"Deployment", "ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    for doc in docs:
        kube_validate(doc, version)


def test_chart_crd_is_the_operator_crd(chart: Any) -> None:
    (crd,) = chart.crds
    assert yaml.safe_load(crd["data"]) == build_crd()


def test_operator_pod_is_non_root_with_read_only_root(chart: Any) -> None:
    (dep,) = [d for d in render(chart) if d["kind"] == "Deployment"]
    pod = dep["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert c["command"] == ["tandem", "operator", "run"] and "--all-namespaces" in c["args"]
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"]["type"] == "Recreate"


def _rules(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [r for d in docs if d["kind"] == kind for r in d["rules"]]


def test_rbac_is_least_privilege(chart: Any) -> None:
    for values in (None, NAMESPACED):
        docs = render(chart, values)
        for rule in _rules(docs, "ClusterRole") + _rules(docs, "Role"):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            assert "secrets" not in rule["resources"]
            assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])


def test_namespaced_install_grants_roles_only_in_watched_namespaces(chart: Any) -> None:
    docs = render(chart, NAMESPACED)
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["research", "serving"]
    (cluster_role,) = [d for d in docs if d["kind"] == "ClusterRole"]
    # Cluster-wide, only reads kopf needs for discovery.
    assert {v for r in cluster_role["rules"] for v in r["verbs"]} == {"list", "watch"}
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert {"--namespace=serving", "--namespace=research"} <= set(dep["spec"]["template"]["spec"]
                                                               ["containers"][0]["args"])


def test_operator_role_covers_every_child_kind(chart: Any) -> None:
    granted = {(g, res) for r in _rules(render(chart), "ClusterRole") for g in r["apiGroups"]
               for res in r["resources"] if "create" in r["verbs"] and "patch" in r["verbs"]}
    for api_version, plural in (("v1", "configmaps"), ("v1", "services"), ("v1", "serviceaccounts"),
                                ("apps/v1", "deployments"), ("rbac.authorization.k8s.io/v1", "roles"),
                                ("rbac.authorization.k8s.io/v1", "rolebindings"),
                                ("policy/v1", "poddisruptionbudgets"),
                                ("networking.k8s.io/v1", "networkpolicies")):
        group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
        assert (group, plural) in granted, plural


@pytest.mark.parametrize("bad", [
    {"image": {"repository": "x", "pullPolicy": "Sometimes"}},
    {"securityContext": {"readOnlyRootFilesystem": False, "allowPrivilegeEscalation": False}},
    {"podSecurityContext": {"runAsNonRoot": False}},
    {"watch": {"allNamespaces": False, "namespaces": ["Not_A_Namespace"]}},
    {"unknownKey": 1},
])
def test_values_schema_rejects_bad_values(chart: Any, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError):
        chart.validate_schema(bad)


def test_values_schema_accepts_defaults_and_namespaced(chart: Any) -> None:
    chart.validate_schema({})
    chart.validate_schema(NAMESPACED)


def test_namespaced_without_namespaces_fails_to_render(chart: Any) -> None:
    with pytest.raises(helm.HelmRenderError, match="watch.namespaces"):
        render(chart, {"watch": {"allNamespaces": False}})
