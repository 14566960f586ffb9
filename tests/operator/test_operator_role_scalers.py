"""Per-role /scale: a RoleScaler per worker role that HPA/KEDA drive for roles listed in
spec.autoscaling.external; the ratio still holds; HPAs that would fight the operator are Degraded."""

from __future__ import annotations

import copy
from typing import Any

import jsonschema
import pytest
from operator_fake_api import FakeApiServer, run_sync

from tandem.operator.reconcile import desired_replicas
from tandem.operator.scaling import role_scaler
from tandem.operator.spec.crd import build_crds
from tandem.operator.spec.service_spec import SpecError, parse_service

SCALERS = "/apis/tandem.dev/v1alpha1/namespaces/serving/rolescalers/"


def _external(autoscaling_cr: dict[str, Any], *roles: str) -> dict[str, Any]:
    cr = copy.deepcopy(autoscaling_cr)
    cr["spec"]["autoscaling"]["external"] = list(roles)
    return cr


def test_each_worker_role_has_a_scale_subresource() -> None:
    crds = {c["spec"]["names"]["kind"]: c for c in build_crds()}
    scale = crds["RoleScaler"]["spec"]["versions"][0]["subresources"]["scale"]
    assert scale == {"specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                     "labelSelectorPath": ".status.selector"}
    assert "scale" in crds["InferenceService"]["spec"]["versions"][0]["subresources"]


def test_sync_seeds_mirrors_and_reports_the_scalers(autoscaling_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    run_sync(server, autoscaling_cr)
    prefill = server.objects[SCALERS + "qwen-chat-prefill"]
    jsonschema.validate(prefill, role_scaler.SCHEMA)
    assert prefill["spec"] == {"service": "qwen-chat", "role": "prefill", "replicas": 2}
    assert prefill["status"]["drivenBy"] == "operator" and prefill["status"]["desiredReplicas"] == 2
    assert prefill["status"]["selector"].endswith("app.kubernetes.io/component=prefill")
    # Someone writes /scale on a role the operator drives: the operator's count wins.
    prefill["spec"]["replicas"] = 7
    run_sync(server, autoscaling_cr)
    assert server.objects[SCALERS + "qwen-chat-prefill"]["spec"]["replicas"] == 2


def test_an_external_role_follows_its_scaler_and_the_ratio_moves_the_other(autoscaling_cr: dict[str, Any]) -> None:
    cr = _external(autoscaling_cr, "decode")
    server = FakeApiServer()
    run_sync(server, cr)
    server.objects[SCALERS + "qwen-chat-decode"]["spec"]["replicas"] = 10  # what an HPA writes
    result = run_sync(server, cr)
    # decode 10 as asked; prefill pulled from 2 into the [0.5, 2] ratio range.
    assert result.status["decode"]["desiredReplicas"] == 10
    assert result.status["prefill"]["desiredReplicas"] == 5
    scaler = server.objects[SCALERS + "qwen-chat-decode"]
    assert scaler["spec"]["replicas"] == 10 and scaler["status"]["drivenBy"] == "external"


def test_external_counts_are_clamped_and_the_ratio_holds_even_against_them(autoscaling_cr: dict[str, Any]) -> None:
    svc = parse_service(_external(autoscaling_cr, "prefill", "decode"))
    got = desired_replicas(svc, {}, {"prefill": 99, "decode": 1})
    assert got.prefill <= 8 and 0.5 <= got.prefill / got.decode <= 2.0


def test_external_lists_only_worker_roles(autoscaling_cr: dict[str, Any]) -> None:
    with pytest.raises(SpecError, match="external"):
        parse_service(_external(autoscaling_cr, "router"))


@pytest.mark.parametrize(("target", "external", "fragment"), [
    ({"kind": "Deployment", "name": "qwen-chat-decode-abc"}, [], "which the operator owns"),
    ({"kind": "RoleScaler", "name": "qwen-chat-prefill"}, [], "does not list prefill"),
    ({"kind": "InferenceService", "name": "qwen-chat"}, [], "built-in autoscaler"),
])
def test_an_hpa_that_would_fight_the_operator_is_degraded(autoscaling_cr: dict[str, Any], target: dict[str, str],
                                                          external: list[str], fragment: str) -> None:
    server = FakeApiServer()
    hpa = {"metadata": {"name": "h"}, "spec": {"scaleTargetRef": {"apiVersion": "x", **target}}}
    server.objects["/apis/autoscaling/v2/namespaces/serving/horizontalpodautoscalers/h"] = hpa
    result = run_sync(server, _external(autoscaling_cr, *external))
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ConflictingAutoscalers" and fragment in degraded["message"]


def test_an_hpa_on_an_external_roles_scaler_is_fine(autoscaling_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    hpa = {"metadata": {"name": "h"}, "spec": {"scaleTargetRef": {"kind": "RoleScaler", "name": "qwen-chat-decode"}}}
    server.objects["/apis/autoscaling/v2/namespaces/serving/horizontalpodautoscalers/h"] = hpa
    result = run_sync(server, _external(autoscaling_cr, "decode"))
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] != "ConflictingAutoscalers"
