"""The chart's ValidatingAdmissionPolicy: the operator's service account may change a pod's
pod-deletion-cost annotation and nothing else. Its CEL (match condition and validations) is
evaluated with cel-python against pods before and after sample patches; the objects themselves
are validated against the Kubernetes schemas in test_operator_chart.py."""

from __future__ import annotations

from typing import Any

import pytest
from operator_support import KUBE_VERSIONS, kube_validate, merge_patch
from operator_support import render_chart as render

from tandem.operator.scaling.deletion_cost import ANNOTATION

celpy = pytest.importorskip("celpy", reason="pip install cel-python (operator-test)")
pytest.importorskip("helm_python", reason="pip install helm-python-sdk (operator-test)")

OPERATOR = "system:serviceaccount:tandem-system:tandem"
POD: dict[str, Any] = {
    "apiVersion": "v1", "kind": "Pod",
    "metadata": {"name": "chat-decode-abc", "namespace": "serving", "labels": {"app": "x"},
                 "annotations": {"prometheus.io/scrape": "true"},
                 "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "rs", "uid": "u"}]},
    "spec": {"containers": [{"name": "decode", "image": "ghcr.io/tandem-serving/tandem-runtime:0.1.0"}]},
}


@pytest.fixture(scope="module")
def policy(chart: Any) -> dict[str, Any]:
    docs = render(chart)
    (vap,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (binding,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": vap["metadata"]["name"], "validationActions": ["Deny"]}
    for version in KUBE_VERSIONS:
        kube_validate(vap, version)
        kube_validate(binding, version)
    return vap


def _run(expression: str, activation: dict[str, Any]) -> bool:
    env = celpy.Environment()
    program = env.program(env.compile(expression))
    return bool(program.evaluate({k: celpy.json_to_cel(v) for k, v in activation.items()}))


def denied(policy: dict[str, Any], old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The messages of the validations that fail for an UPDATE from `old` to `new`."""
    return [v["message"] for v in policy["spec"]["validations"]
            if not _run(v["expression"], {"object": new, "oldObject": old})]


def test_policy_matches_pod_updates_by_the_operator_only(policy: dict[str, Any]) -> None:
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}]
    (condition,) = spec["matchConditions"]
    assert _run(condition["expression"], {"request": {"userInfo": {"username": OPERATOR}}})
    for other in ("system:serviceaccount:tandem-system:default", "system:serviceaccount:serving:tandem", "alice"):
        assert not _run(condition["expression"], {"request": {"userInfo": {"username": other}}})


def test_the_operators_own_patch_passes(policy: dict[str, Any]) -> None:
    # deletion_cost.mark() sends exactly this merge patch.
    for old in (POD, merge_patch(POD, {"metadata": {"annotations": {ANNOTATION: "300"}}}),
                merge_patch(POD, {"metadata": {"annotations": None}})):
        new = merge_patch(old, {"metadata": {"annotations": {ANNOTATION: "0"}}})
        assert denied(policy, old, new) == []
    # Removing the annotation again is the same one field.
    marked = merge_patch(POD, {"metadata": {"annotations": {ANNOTATION: "5"}}})
    assert denied(policy, marked, merge_patch(marked, {"metadata": {"annotations": {ANNOTATION: None}}})) == []


@pytest.mark.parametrize("patch, says", [
    ({"spec": {"containers": [{"name": "decode", "image": "evil:latest"}]}}, "not its spec"),
    ({"spec": {"activeDeadlineSeconds": 1}}, "not its spec"),
    ({"metadata": {"labels": {"app": "y"}}}, "not its labels"),
    ({"metadata": {"labels": None}}, "not its labels"),
    ({"metadata": {"finalizers": ["x/hold"]}}, "not its finalizers"),
    ({"metadata": {"ownerReferences": None}}, "not its ownerReferences"),
    ({"metadata": {"annotations": {"prometheus.io/scrape": "false"}}}, "no other annotation"),
    ({"metadata": {"annotations": {"prometheus.io/scrape": None, ANNOTATION: "1"}}}, "no other annotation"),
    ({"metadata": {"annotations": {"sidecar.istio.io/inject": "true"}}}, "no other annotation"),
], ids=["image", "deadline", "label", "labels-removed", "finalizer", "owner-removed", "annotation-changed",
        "annotation-removed", "annotation-added"])
def test_any_other_change_is_denied(policy: dict[str, Any], patch: dict[str, Any], says: str) -> None:
    messages = denied(policy, POD, merge_patch(POD, patch))
    assert messages and all(says in m or "only a pod's" in m for m in messages)
    assert any(says in m for m in messages)


def test_the_policy_can_be_turned_off(chart: Any) -> None:
    kinds = {d["kind"] for d in render(chart, {"security": {"restrictPodPatches": False}})}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}


def test_the_policy_names_the_operators_service_account(chart: Any) -> None:
    docs = render(chart, {"serviceAccount": {"create": True, "name": "ops"}})
    (vap,) = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy"]
    (condition,) = vap["spec"]["matchConditions"]
    assert _run(condition["expression"], {"request": {"userInfo": {"username":
                                                                   "system:serviceaccount:tandem-system:ops"}}})
    (dep,) = [d for d in docs if d["kind"] == "Deployment"]
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "ops"
