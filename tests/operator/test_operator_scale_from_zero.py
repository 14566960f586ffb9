"""Scale from zero: minReplicas 0 per role; the router's held requests wake a role at zero, on the
fluid model and through sync(); an idle service goes back to zero only when both roles are idle."""

from __future__ import annotations

import copy
from typing import Any

from operator_fake_api import FakeApiServer, run_sync

from tandem.operator.scaling.autoscale_round import plan
from tandem.operator.scaling.decision import Observation, Policy, RolePolicy, decide, initial_state
from tandem.operator.scaling.signals import RoleMetrics
from tandem.operator.scaling.simulate import ClusterModel, simulate
from tandem.operator.spec.sections import StepRule
from tandem.operator.spec.service_spec import parse_service

POLICY = Policy(
    prefill=RolePolicy("queueDepth", 3.0, 0, 8),
    decode=RolePolicy("kvUtilization", 0.7, 0, 8),
    ratio_min=0.25, ratio_max=2.0, tolerance=0.1,
    up=StepRule(stabilization_s=30, cooldown_s=60, max_step=2),
    down=StepRule(stabilization_s=120, cooldown_s=60, max_step=1),
)


def test_held_requests_wake_both_roles_at_once() -> None:
    state = initial_state(0, 0)
    assert decide(POLICY, state, Observation(None, None), 0.0).state.prefill.replicas == 0
    woke = decide(POLICY, state, Observation(None, None, decode_pending=1), 0.0)
    # No window, no cooldown; the ratio brings prefill along with decode.
    assert (woke.prefill, woke.decode) == (1, 1)
    assert any("scale from zero" in r for r in woke.reasons)


def test_a_request_arriving_at_zero_completes_and_the_service_returns_to_zero() -> None:
    """Fluid model: one request at t=10 into a service at (0, 0) with a 60 s pod start-up."""
    model = ClusterModel(startup_s=60.0)
    ticks = simulate(POLICY, lambda t: 1.0 if t == 10 else 0.0, 900, model, start=(0, 0))
    woke = next(t for t in ticks if t.prefill > 0)
    assert woke.t <= 15 + 1e-9 and woke.decode > 0  # the first decision after it arrived
    served = next(t for t in ticks if t.completed >= 0.99)
    assert served.t >= woke.t + model.startup_s  # it waited for pods, then completed
    assert ticks[-1].prefill == 0 and ticks[-1].decode == 0  # idle again: back to zero
    assert all((t.prefill == 0) == (t.decode == 0) for t in ticks)  # zero only together


def _zero_cr(minimal_cr: dict[str, Any]) -> dict[str, Any]:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["prefill"] = {"replicas": 0, "minReplicas": 0, "maxReplicas": 4}
    cr["spec"]["decode"] = {"replicas": 0, "minReplicas": 0, "maxReplicas": 4}
    cr["spec"]["autoscaling"] = {"enabled": True}
    return cr


def test_sync_scales_a_role_up_from_the_routers_demand(minimal_cr: dict[str, Any], monkeypatch) -> None:
    from tandem.operator import sync as sync_module

    cr = _zero_cr(minimal_cr)
    server = FakeApiServer()
    result = run_sync(server, cr)
    assert result.status["decode"]["desiredReplicas"] == 0
    cr["status"] = result.status
    demand = {"prefill": RoleMetrics(), "decode": RoleMetrics(pending=2.0)}

    async def metrics(*_: Any) -> dict[str, RoleMetrics]:
        return demand

    monkeypatch.setattr(sync_module, "_metrics", metrics)
    result = run_sync(server, cr, autoscale=True)
    assert (result.status["prefill"]["desiredReplicas"], result.status["decode"]["desiredReplicas"]) == (1, 1)
    deps = [o for p, o in server.objects.items() if "/deployments/llama3-8b-decode-" in p]
    assert deps[0]["spec"]["replicas"] == 1


def test_plan_reports_demand_as_activity(minimal_cr: dict[str, Any]) -> None:
    svc = parse_service(_zero_cr(minimal_cr))
    out = plan(svc, {}, {"decode": RoleMetrics(pending=1.0)}, None, now=0.0)
    assert out.report.active and out.state is not None and out.state.decode.replicas == 1


def test_scale_down_marks_the_least_loaded_pods_for_deletion(autoscaling_cr: dict[str, Any]) -> None:
    """Before a decode scale-down the operator sets pod-deletion-cost from each pod's load."""
    from tandem.operator.scaling import deletion_cost
    from tandem.operator.scaling.autoscale_round import ServiceMemory
    from tandem.operator.scaling.metrics_source import ScrapeReader
    from tandem.operator.scaling.signals import PodMetrics

    server = FakeApiServer()
    run_sync(server, autoscaling_cr)
    (path,) = [p for p in server.objects if "/deployments/qwen-chat-decode-" in p]
    server.objects[path]["spec"]["replicas"] = 4  # running 4; the spec asks for 2: a scale-down
    selector = server.objects[path]["spec"]["selector"]["matchLabels"]
    for name in ("busy", "idle", "mid"):
        server.objects[f"/api/v1/namespaces/serving/pods/{name}"] = {"metadata": {"name": name, "labels": selector}}
    memory = ServiceMemory(scrape=ScrapeReader(None))  # type: ignore[arg-type]
    memory.scrape._previous["decode"] = {  # what the last scrape saw
        "busy": PodMetrics("busy", queue=3, running=40), "idle": PodMetrics("idle", queue=0, running=0),
        "mid": PodMetrics("mid", queue=0, running=2.5)}
    run_sync(server, autoscaling_cr, memory=memory)
    costs = {n: server.objects[f"/api/v1/namespaces/serving/pods/{n}"]["metadata"]["annotations"][
        deletion_cost.ANNOTATION] for n in ("busy", "idle", "mid")}
    assert costs == {"busy": "4300", "idle": "0", "mid": "250"}
    assert deletion_cost.patches(list(server.objects.values())[-3:], {"idle": 0.0}) == {}  # no churn
