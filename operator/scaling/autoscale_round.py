"""One autoscaling round for one InferenceService: metrics in, replica counts and a status section out.

`plan` is pure: it takes the metrics already read and the in-memory ScalerState and
returns the new state, what to report in status.autoscaler and the ScalingActive
condition. `read_metrics` is the only part that does I/O.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from tandem.operator import names
from tandem.operator.kubeapi import KubeApi
from tandem.operator.reconcile import desired_replicas
from tandem.operator.scaling.decision import Decision, Observation, Policy, ScalerState, decide, initial_state
from tandem.operator.scaling.metrics_source import PrometheusReader, ScrapeReader, ready_pods
from tandem.operator.scaling.signals import RoleMetrics, signal_value
from tandem.operator.spec.service_spec import ServiceSpec
from tandem.operator.status import Measured, ScalingReport


@dataclass
class ServiceMemory:
    """Per-CR memory kept across handler calls in kopf's per-object memo; losing it is safe."""

    scaler: ScalerState | None = None
    scrape: ScrapeReader | None = None
    measured: Measured = field(default_factory=Measured)
    report: ScalingReport | None = None
    last_decision: str = ""
    applied: str = ""  # fingerprint of the children last applied, and when (monotonic seconds)
    applied_at: float = 0.0
    # (apiVersion, kind) of children the last apply found no CRD for (reconcile.OPTIONAL_KINDS)
    missing_kinds: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Plan:
    state: ScalerState | None
    status: dict[str, Any]  # status.autoscaler
    report: ScalingReport
    measured: Measured


def to_iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return datetime.datetime.fromtimestamp(ts, tz=datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def from_iso(value: Any) -> float | None:
    if not isinstance(value, str):
        return None
    try:
        return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return None


def measured_from(metrics: dict[str, RoleMetrics]) -> Measured:
    prefill = metrics.get(names.PREFILL, RoleMetrics())
    decode = metrics.get(names.DECODE, RoleMetrics())
    return Measured(ttft_p95_s=prefill.ttft_p95_s, itl_p95_s=decode.itl_p95_s,
                    handshake_ok=decode.handshake_ok)


def _starting_state(svc: ServiceSpec, status: dict[str, Any], state: ScalerState | None,
                    external: dict[str, int] | None) -> ScalerState:
    base = desired_replicas(svc, status, external)
    if state is not None and (state.prefill.replicas, state.decode.replicas) == (base.prefill, base.decode):
        return state
    # After a restart or a spec edit: start from the persisted counts and cooldown clocks, no history.
    auto = status.get("autoscaler") or {}
    ups = {r: from_iso((auto.get(r) or {}).get("lastScaleUpTime")) for r in names.WORKER_ROLES}
    downs = {r: from_iso((auto.get(r) or {}).get("lastScaleDownTime")) for r in names.WORKER_ROLES}
    return initial_state(base.prefill, base.decode, ups, downs)


def _role_status(svc: ServiceSpec, decision_state: ScalerState, role: str,
                 value: float | None) -> dict[str, Any]:
    rule = svc.autoscaling.prefill if role == names.PREFILL else svc.autoscaling.decode
    state = decision_state.prefill if role == names.PREFILL else decision_state.decode
    out: dict[str, Any] = {
        "replicas": state.replicas,
        "signal": rule.signal,
        "target": rule.target,
        "specReplicas": svc.role(role).replicas,
    }
    if value is not None:
        out["value"] = round(value, 6)
    for key, ts in (("lastScaleUpTime", state.last_up), ("lastScaleDownTime", state.last_down)):
        if ts is not None:
            out[key] = to_iso(ts)
    return out


def _observation(svc: ServiceSpec, metrics: dict[str, RoleMetrics]) -> Observation:
    """Signals per role; a role an external autoscaler drives gets none, so the built-in holds it."""
    auto = svc.autoscaling
    got = {role: RoleMetrics() if role in auto.external else metrics.get(role, RoleMetrics())
           for role in names.WORKER_ROLES}
    return Observation(
        prefill=signal_value(auto.prefill.signal, got[names.PREFILL]),
        decode=signal_value(auto.decode.signal, got[names.DECODE]),
        prefill_pending=got[names.PREFILL].pending, decode_pending=got[names.DECODE].pending,
    )


def plan(svc: ServiceSpec, status: dict[str, Any], metrics: dict[str, RoleMetrics],
         state: ScalerState | None, now: float, last_decision: str = "",
         external: dict[str, int] | None = None) -> Plan:
    measured = measured_from(metrics)
    if not svc.autoscaling.enabled:
        return Plan(None, {}, ScalingReport(False, "Disabled", "spec.autoscaling.enabled is false"), measured)
    start = _starting_state(svc, status, state, external)
    auto = svc.autoscaling
    obs = _observation(svc, metrics)
    decision: Decision = decide(Policy.from_spec(svc), start, obs, now)
    text = "; ".join(decision.reasons) or last_decision
    section = {
        names.PREFILL: _role_status(svc, decision.state, names.PREFILL, obs.prefill),
        names.DECODE: _role_status(svc, decision.state, names.DECODE, obs.decode),
        "ratio": round(decision.prefill / max(decision.decode, 1), 4),
    }
    if text:
        section["lastDecision"] = text
    if obs.prefill is None and obs.decode is None and not (obs.prefill_pending or obs.decode_pending):
        report = ScalingReport(False, "MetricsUnavailable",
                               f"no {auto.source} metrics from ready worker pods; holding replica counts")
    else:
        report = ScalingReport(True, "Active", text or "within targets")
    return Plan(decision.state, section, report, measured)


async def read_metrics(api: KubeApi, http: httpx.AsyncClient, svc: ServiceSpec,
                       memory: ServiceMemory) -> dict[str, RoleMetrics]:
    if svc.autoscaling.source == "prometheus" and svc.autoscaling.prometheus_url:
        return await PrometheusReader(http, svc.autoscaling.prometheus_url).read(svc.namespace, svc.name)
    if memory.scrape is None:
        memory.scrape = ScrapeReader(http)
    pods = {
        role: ready_pods(await api.list("v1", "Pod", svc.namespace, names.selector_labels(svc.name, role)))
        for role in names.ROLES
    }
    routers = pods.pop(names.ROUTER)
    got = await memory.scrape.read(pods)
    pending = await memory.scrape.read_pending(routers)
    return {role: replace(got.get(role, RoleMetrics()), pending=pending[role]) for role in names.WORKER_ROLES}
