"""The API client and one sync pass against a scripted API (httpx.MockTransport): server-side apply,
error mapping to kopf.TemporaryError / PermanentError, Degraded on bad specs, pruning."""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import httpx
import kopf
import pytest
from operator_fake_api import FakeApiServer, run_sync

from tandem.operator.kubeapi import ApiError, KubeApi, resource_path


def test_sync_applies_every_child_and_reports_status(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    result = run_sync(server, minimal_cr)
    assert result.error is None
    patches = [p for m, p in server.calls if m == "PATCH"]
    objects = sorted({p for p in patches if not p.endswith("/status")})
    assert len(objects) == 17 and "/configmaps/llama3-8b-engine-" in patches[0]
    assert any(p.startswith("/apis/apps/v1/namespaces/default/deployments/llama3-8b-decode-") for p in patches)
    assert result.status["conditions"][0]["type"] == "PrefillReady"
    assert result.status["decode"]["desiredReplicas"] == 1


def test_sync_twice_is_a_no_op_for_the_objects(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    run_sync(server, minimal_cr)
    snapshot = copy.deepcopy(server.objects)
    run_sync(server, minimal_cr)
    # The 17 applied children and the PD Secret, created once: the second pass keeps its key.
    assert server.objects == snapshot and len(snapshot) == 18


def test_invalid_spec_gives_degraded_and_permanent_error(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["model"] = {"servedName": "m", "uri": "hf://m"}
    server = FakeApiServer()
    result = run_sync(server, cr)
    assert isinstance(result.error, kopf.PermanentError)
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["status"] == "True" and degraded["reason"] == "InvalidSpec"
    assert "reserved" in degraded["message"]
    assert server.calls == []  # nothing is applied from a spec the operator cannot trust


@pytest.mark.parametrize("code", [409, 429, 500, 503])
def test_conflicts_and_outages_are_retried(minimal_cr: dict[str, Any], code: int) -> None:
    server = FakeApiServer()
    server.fail["PATCH /apis/apps/v1"] = (code, "Conflict")
    with pytest.raises(kopf.TemporaryError) as err:
        run_sync(server, minimal_cr)
    assert err.value.delay == 10


def test_rejected_child_gives_degraded(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    server.fail["PATCH /apis/networking.k8s.io"] = (422, "Invalid")
    result = run_sync(server, minimal_cr)
    assert isinstance(result.error, kopf.PermanentError)
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "ApplyFailed" and "422" in degraded["message"]


def test_prune_removes_only_owned_strays(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    run_sync(server, minimal_cr)
    labels = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": "llama3-8b"}
    owner = {"uid": minimal_cr["metadata"]["uid"], "controller": True}
    stray = resource_path("v1", "ConfigMap", "default", "llama3-8b-old")
    foreign = resource_path("v1", "ConfigMap", "default", "llama3-8b-user")
    server.objects[stray] = {"metadata": {"name": "llama3-8b-old", "labels": labels,
                                          "ownerReferences": [owner]}}
    server.objects[foreign] = {"metadata": {"name": "llama3-8b-user", "labels": labels}}
    run_sync(server, minimal_cr)
    assert stray not in server.objects and foreign in server.objects


def test_metrics_failures_do_not_block_apply(autoscaling_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    server.fail["GET /api/v1/namespaces/serving/pods"] = (403, "Forbidden")
    result = run_sync(server, autoscaling_cr, autoscale=True, prune=False)
    assert result.error is None
    scaling = next(c for c in result.status["conditions"] if c["type"] == "ScalingActive")
    assert scaling["reason"] == "MetricsUnavailable"
    assert result.status["autoscaler"]["prefill"]["replicas"] == 2


def test_api_error_classification() -> None:
    assert ApiError(409, "Conflict", "").transient and ApiError(504, "Timeout", "").transient
    assert not ApiError(403, "Forbidden", "").transient and not ApiError(422, "Invalid", "").transient


def test_client_maps_404_to_none_and_transport_errors_to_503() -> None:
    def boom(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    async def go() -> None:
        fake = httpx.MockTransport(FakeApiServer())
        async with httpx.AsyncClient(base_url="http://api", transport=fake) as c:
            assert await KubeApi(c).get("apps/v1", "Deployment", "ns", "missing") is None
        async with httpx.AsyncClient(base_url="http://api", transport=httpx.MockTransport(boom)) as c:
            with pytest.raises(ApiError) as err:
                await KubeApi(c).get("apps/v1", "Deployment", "ns", "x")
            assert err.value.status == 503 and err.value.transient

    asyncio.run(go())


def test_turning_autoscaling_off_drops_its_status(minimal_cr: dict[str, Any]) -> None:
    cr = {**minimal_cr, "status": {"autoscaler": {"prefill": {"replicas": 4, "specReplicas": 1}}}}
    result = run_sync(FakeApiServer(), cr, autoscale=True)
    assert result.status["autoscaler"] is None  # a merge-patch null removes the stale section
    assert result.status["prefill"]["desiredReplicas"] == 1
