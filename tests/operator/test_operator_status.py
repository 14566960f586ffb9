"""Status and conditions from observed Deployments: Ready means a real prefill -> decode path exists."""

from __future__ import annotations

from typing import Any

import jsonschema

from tandem.operator import names
from tandem.operator.conditions import condition_status
from tandem.operator.reconcile import RoleReplicas
from tandem.operator.spec.service_spec import parse_service
from tandem.operator.spec.status_schema import STATUS_SCHEMA
from tandem.operator.status import (
    Measured,
    RoleObserved,
    ScalingReport,
    build_status,
    invalid_status,
    observe_deployment,
)

DESIRED = RoleReplicas(prefill=2, decode=2, router=1)
OFF = ScalingReport(False, "Disabled", "spec.autoscaling.enabled is false")
T0, T1 = "2030-01-01T00:00:00Z", "2030-01-01T00:05:00Z"


def observed(prefill: int = 2, decode: int = 2, router: int = 1,
             updated: bool = True) -> dict[str, RoleObserved]:
    def role(ready: int, want: int) -> RoleObserved:
        return RoleObserved(True, want, ready, want if updated else 0, True)

    return {names.PREFILL: role(prefill, 2), names.DECODE: role(decode, 2), names.ROUTER: role(router, 1)}


def conds(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}


def status_for(cr: dict[str, Any], obs: dict[str, RoleObserved], measured: Measured = Measured(),
               previous: dict[str, Any] | None = None, now: str = T0) -> dict[str, Any]:
    return build_status(parse_service(cr), DESIRED, obs, measured, OFF, previous or {}, now)


def test_all_ready_means_ready(minimal_cr: dict[str, Any]) -> None:
    status = status_for(minimal_cr, observed())
    jsonschema.Draft4Validator(STATUS_SCHEMA).validate(status)
    c = conds(status)
    assert c["Ready"] == ("True", "PrefillDecodePathReady")
    assert c["Progressing"] == ("False", "Stable") and c["Degraded"] == ("False", "AsExpected")
    assert c["ScalingActive"] == ("False", "Disabled")
    assert status["url"] == "http://llama3-8b.default.svc.cluster.local"
    assert status["observedGeneration"] == 1
    selector = ("app.kubernetes.io/name=tandem,app.kubernetes.io/instance=llama3-8b,"
                "app.kubernetes.io/component=decode")
    assert status["decode"] == {"desiredReplicas": 2, "replicas": 2, "readyReplicas": 2, "updatedReplicas": 2,
                                "selector": selector}


def test_no_ready_decode_means_no_path(minimal_cr: dict[str, Any]) -> None:
    c = conds(status_for(minimal_cr, observed(decode=0)))
    assert c["DecodeReady"] == ("False", "NoReadyPods")
    assert c["Ready"] == ("False", "DecodeNotReady")
    assert c["Degraded"] == ("True", "ReplicasUnavailable")


def test_handshake_failure_reported_by_metrics_blocks_ready(minimal_cr: dict[str, Any]) -> None:
    c = conds(status_for(minimal_cr, observed(), Measured(handshake_ok=False)))
    assert c["Ready"] == ("False", "KVHandshakeFailed")


def test_rollout_in_progress(minimal_cr: dict[str, Any]) -> None:
    c = conds(status_for(minimal_cr, observed(updated=False)))
    assert c["Progressing"] == ("True", "RollingOut")
    assert c["Degraded"][0] == "False"  # being behind during a rollout is not degradation


def test_missing_deployments(minimal_cr: dict[str, Any]) -> None:
    obs = {role: RoleObserved() for role in names.ROLES}
    c = conds(status_for(minimal_cr, obs))
    assert c["PrefillReady"] == ("False", "NotCreated") and c["Ready"][0] == "False"


def test_transition_time_moves_only_on_flips(minimal_cr: dict[str, Any]) -> None:
    first = status_for(minimal_cr, observed(decode=0), now=T0)
    same = status_for(minimal_cr, observed(decode=0), previous=first, now=T1)
    flipped = status_for(minimal_cr, observed(), previous=first, now=T1)

    def when(status: dict[str, Any], kind: str) -> str:
        return next(c["lastTransitionTime"] for c in status["conditions"] if c["type"] == kind)

    assert when(same, "Ready") == T0 and when(flipped, "Ready") == T1
    assert when(flipped, "PrefillReady") == T0


def test_slo_attainment(minimal_cr: dict[str, Any]) -> None:
    cr = {**minimal_cr, "spec": {**minimal_cr["spec"], "slo": {"ttftP95Seconds": 1.0, "itlP95Seconds": 0.05}}}
    status = status_for(cr, observed(), Measured(ttft_p95_s=1.4, itl_p95_s=0.03), now=T1)
    assert status["slo"] == {"ttftTargetSeconds": 1.0, "ttftP95Seconds": 1.4, "ttftAttained": False,
                             "itlTargetSeconds": 0.05, "itlP95Seconds": 0.03, "itlAttained": True,
                             "measuredAt": T1}


def test_invalid_status_is_degraded_with_the_message() -> None:
    status = invalid_status({}, 3, "InvalidSpec", "spec.model.uri is reserved", T0)
    assert condition_status(status["conditions"], "Degraded") == "True"
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert degraded["message"] == "spec.model.uri is reserved" and degraded["observedGeneration"] == 3
    jsonschema.Draft4Validator(STATUS_SCHEMA).validate(status)


def test_observe_deployment_reads_counts_and_generation() -> None:
    dep = {"metadata": {"generation": 4}, "status": {"observedGeneration": 3, "replicas": 2,
                                                     "readyReplicas": 1, "updatedReplicas": 1}}
    assert observe_deployment(dep) == RoleObserved(True, 2, 1, 1, False)
    assert observe_deployment(None) == RoleObserved()
