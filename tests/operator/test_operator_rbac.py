"""The chart's RBAC against what the operator's code uses: nothing missing, nothing extra.

USED is the table of record, each verb with the reason it is needed. Three checks keep it honest:
every API call in operator/ whose resource can be read off the call (a static scan), and the
apply/list/delete of every kind in CHILD_KINDS, must be granted; and every rule the operator
puts into a Role it creates must be held by the operator (RBAC forbids granting more than one
holds, short of the `escalate` verb, which the operator does not get).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from typing import Any

import pytest
from operator_support import example_paths, load_example
from operator_support import render_chart as render

import tandem.operator as operator_pkg
from tandem.operator import names
from tandem.operator.kubeapi import PLURALS
from tandem.operator.reconcile import CHILD_KINDS, reconcile
from tandem.operator.security.operator_policy import OperatorPolicy

pytest.importorskip("helm_python", reason="pip install helm-python-sdk (operator-test)")

Key = tuple[str, str]  # (apiGroup, resource)
CHILD = {"get", "list", "create", "patch", "delete"}  # apply = create + patch; pruning = list + delete
USED: dict[Key, tuple[set[str], str]] = {
    ("tandem.dev", "inferenceservices"): ({"list", "watch", "patch"}, "kopf: watch stream, finalizer, annotations"),
    ("tandem.dev", "inferenceservices/status"): ({"patch"}, "kopf writes the status the handlers return"),
    ("tandem.dev", "rolescalers"): (CHILD | {"watch"}, "a child; watch as the RoleScaler design asks"),
    ("tandem.dev", "rolescalers/status"): ({"get", "patch"}, "scaling/role_scaler.py merge-patches the scale readout"),
    ("apps", "deployments"): (CHILD, "child; rollout/generation_deployments.py merge-patches replicas"),
    ("", "services"): (CHILD, "child"),
    ("", "configmaps"): (CHILD, "child"),
    ("", "serviceaccounts"): (CHILD, "child"),
    ("rbac.authorization.k8s.io", "roles"): (CHILD, "child"),
    ("rbac.authorization.k8s.io", "rolebindings"): (CHILD, "child"),
    ("policy", "poddisruptionbudgets"): (CHILD, "child"),
    ("networking.k8s.io", "networkpolicies"): (CHILD, "child"),
    ("inference.networking.k8s.io", "inferencepools"): (CHILD, "child (spec.gateway); its CRD may be absent"),
    ("gateway.networking.k8s.io", "httproutes"): (CHILD, "child (spec.gateway.httpRoute); its CRD may be absent"),
    ("", "pods"): ({"get", "list", "watch", "patch"},
                   "list: metrics and status; patch: pod-deletion-cost; get/watch: granted to the router"),
    ("autoscaling", "horizontalpodautoscalers"): ({"get", "list"}, "detect an HPA fighting the autoscaler"),
    ("", "secrets"): ({"get", "create"}, "security/pd_secret.py: the PD key, created once, read back to check it"),
    ("", "events"): ({"create"}, "kopf posts core/v1 events"),
}
PEERING_VERBS = {"get", "list", "watch", "patch"}  # kopf's documented peering RBAC
DISCOVERY = {("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
             ("", "namespaces"): {"list", "watch"}}
# KubeApi methods and the verbs they need.
METHOD_VERBS = {"apply": {"create", "patch"}, "merge_patch": {"patch"}, "get": {"get"}, "list": {"list"},
                "delete": {"delete"}, "create": {"create"}}
NAMESPACED = {"watch": {"allNamespaces": False, "namespaces": ["serving", "research"]}}
ALL_NAMESPACES = {"watch": {"allNamespaces": True}}
STANDALONE = {"leaderElection": {"enabled": False}}


def grants(rules: list[dict[str, Any]]) -> dict[Key, set[str]]:
    out: dict[Key, set[str]] = {}
    for rule in rules:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def role_rules(docs: list[dict[str, Any]], kind: str, name: str = "tandem") -> list[dict[str, Any]]:
    return [r for d in docs if d["kind"] == kind and d["metadata"]["name"] == name for r in d["rules"]]


def key_of(api_version: str, kind: str, subresource: str | None = None) -> Key:
    group = api_version.rsplit("/", 1)[0] if "/" in api_version else ""
    resource = PLURALS[kind] + (f"/{subresource}" if subresource else "")
    return group, resource


def _resolve(node: ast.expr | None, module: Any) -> Any:
    if node is None:
        return None
    try:
        return eval(compile(ast.Expression(node), "<rbac>", "eval"), vars(module))  # noqa: S307 (our code)
    except Exception:
        return None  # a local variable: the CHILD_KINDS check covers those calls


def scanned_calls() -> set[tuple[Key, str]]:
    """(resource, verb) for every `api.<method>(apiVersion, Kind, ...)` in operator/ (sub-packages included)
    whose apiVersion and Kind are literals or module-level names."""
    found: set[tuple[Key, str]] = set()
    for info in pkgutil.walk_packages(operator_pkg.__path__, "tandem.operator."):
        module = importlib.import_module(info.name)
        tree = ast.parse(open(module.__file__, encoding="utf-8").read())  # type: ignore[arg-type]
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                    and isinstance(call.func.value, ast.Name) and call.func.value.id == "api"
                    and call.func.attr in METHOD_VERBS and len(call.args) >= 2):
                continue
            api_version, kind = _resolve(call.args[0], module), _resolve(call.args[1], module)
            sub = next((k.value for k in call.keywords if k.arg == "subresource"), None)
            if isinstance(api_version, str) and isinstance(kind, str):
                resource = key_of(api_version, kind, _resolve(sub, module))
                found |= {(resource, verb) for verb in METHOD_VERBS[call.func.attr]}
    return found


def test_granted_verbs_equal_the_table(chart: Any) -> None:
    for values in (ALL_NAMESPACES, {**ALL_NAMESPACES, **STANDALONE}):
        granted = grants(role_rules(render(chart, values), "ClusterRole"))
        granted.pop(("kopf.dev", "clusterkopfpeerings"), None)
        assert granted == {key: verbs for key, (verbs, _) in USED.items()}


def test_every_api_call_in_the_code_is_granted() -> None:
    calls = scanned_calls()
    assert len(calls) >= 8  # the scan sees the code (get, list, delete, merge_patch on several kinds)
    missing = {(key, verb) for key, verb in calls if verb not in USED.get(key, (set(), ""))[0]}
    assert missing == set()


def test_every_child_kind_can_be_applied_pruned_and_read() -> None:
    for api_version, kind in CHILD_KINDS:
        assert CHILD <= USED[key_of(api_version, kind)][0], kind


def test_the_operator_holds_whatever_its_roles_grant(chart: Any) -> None:
    granted = grants(role_rules(render(chart), "Role"))
    for path in example_paths():
        for child in reconcile(load_example(path), OperatorPolicy(allow_host_access=True)):
            if child["kind"] != "Role":
                continue
            for key, verbs in grants(child["rules"]).items():
                assert verbs <= granted.get(key, set()), (path.name, key, verbs)


def test_no_wildcards_secret_reads_updates_or_escalation(chart: Any) -> None:
    for values in (None, NAMESPACED, ALL_NAMESPACES):
        docs = render(chart, values)
        for rule in [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]:
            assert "*" not in rule["verbs"] and "*" not in rule["resources"] and "*" not in rule["apiGroups"]
            # Secrets: create the PD key and get it back; never list or watch every Secret's data.
            assert "secrets" not in rule["resources"] or set(rule["verbs"]) == {"get", "create"}
            assert not {"escalate", "bind", "impersonate", "update", "deletecollection"} & set(rule["verbs"])


def test_cluster_wide_writes_only_in_all_namespaces_mode(chart: Any) -> None:
    docs = render(chart, NAMESPACED)
    cluster_roles = [d for d in docs if d["kind"] == "ClusterRole"]
    assert [d["metadata"]["name"] for d in cluster_roles] == ["tandem-discovery"]
    assert grants(cluster_roles[0]["rules"]) == DISCOVERY
    roles = [d for d in docs if d["kind"] == "Role"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["research", "serving"]
    for role in roles:
        granted = grants(role["rules"])
        assert granted.pop(("kopf.dev", "kopfpeerings")) == PEERING_VERBS
        assert granted == {key: verbs for key, (verbs, _) in USED.items()}
    bindings = [d for d in docs if d["kind"] == "RoleBinding"]
    assert all(b["subjects"][0]["namespace"] == "tandem-system" for b in bindings)
    assert grants(role_rules(render(chart), "ClusterRole", "tandem-discovery")) == DISCOVERY


@pytest.mark.parametrize("values, cluster, namespaced", [
    (ALL_NAMESPACES, PEERING_VERBS, None),
    (None, None, PEERING_VERBS),
    (NAMESPACED, None, PEERING_VERBS),
    (STANDALONE, None, None),
    ({**ALL_NAMESPACES, **STANDALONE}, None, None),
], ids=["all-namespaces", "default", "namespaced", "standalone", "all-namespaces-standalone"])
def test_peering_rules_follow_the_mode(chart: Any, values: Any, cluster: Any, namespaced: Any) -> None:
    docs = render(chart, values)
    everything = [r for d in docs if d["kind"] in ("ClusterRole", "Role") for r in d["rules"]]
    cluster_grants = grants([r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"]])
    assert cluster_grants.get(("kopf.dev", "clusterkopfpeerings")) == cluster
    assert cluster_grants.get(("kopf.dev", "kopfpeerings")) is None
    role_grants = [grants(d["rules"]) for d in docs if d["kind"] == "Role"]
    assert all(g.get(("kopf.dev", "kopfpeerings")) == namespaced for g in role_grants)
    if cluster is None and namespaced is None:
        assert not [r for r in everything if "kopf.dev" in r["apiGroups"]]


def test_table_uses_the_operators_own_group() -> None:
    assert {g for g, _ in USED if "tandem" in g} == {names.GROUP}
