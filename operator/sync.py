"""One level-based pass over an InferenceService: the only code the kopf handlers call.

  parse spec -> policy -> (timer: read metrics, autoscale) -> PD Secret (created once)
  -> rollout step -> reconcile -> server-side apply -> scale and retire old generations -> prune strays -> status

Errors: an invalid spec or a rejected manifest gives a Degraded status and
kopf.PermanentError; conflicts, throttling and API outages give kopf.TemporaryError.
A child whose CRD the cluster lacks (the gateway's: reconcile.OPTIONAL_KINDS) is skipped and
named in the GatewayConfigured condition; everything else still applies.
The status to write is returned even when an error follows, so the caller can
patch it before raising.
"""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import httpx
import kopf

from tandem.operator import names
from tandem.operator.child_meta import is_owned_by
from tandem.operator.conditions import Condition, merge_conditions
from tandem.operator.kubeapi import ApiError, KubeApi
from tandem.operator.reconcile import CHILD_KINDS, OPTIONAL_KINDS, RoleReplicas, desired_children, desired_replicas
from tandem.operator.rollout import generation_deployments as gens
from tandem.operator.rollout.generation_hash import generation_of
from tandem.operator.rollout.step import GenCounts, Step, step
from tandem.operator.scaling import deletion_cost, role_scaler
from tandem.operator.scaling.autoscale_round import ServiceMemory, plan, read_metrics
from tandem.operator.security import pd_secret
from tandem.operator.security.operator_policy import OperatorPolicy, policy_problems
from tandem.operator.spec.service_spec import ServiceSpec, SpecError, parse_service
from tandem.operator.spec.unknown_fields import unknown_fields
from tandem.operator.status import (
    ClusterView,
    ScalingReport,
    build_status,
    invalid_status,
    observe_deployment,
    pod_problems,
)
from tandem.operator.worker_failures import worker_failures

RETRY_DELAY_S = 10
# The timer skips re-applying an unchanged set of children for this long; create, update
# and resume always apply, and a missing Deployment triggers an apply at once.
RESYNC_S = 300.0
# A metrics round (every pod's /metrics, or a handful of PromQL queries) gives up after this long.
METRICS_ROUND_S = 12.0


@dataclass(frozen=True)
class SyncResult:
    status: dict[str, Any]
    error: kopf.TemporaryError | kopf.PermanentError | None = None
    warnings: tuple[str, ...] = ()  # unknown spec fields: the handler posts them as a Warning event


def _with_warnings(result: SyncResult, cr: dict[str, Any]) -> SyncResult:
    """Add the SpecWarnings condition: unknown fields (typos, fields of a newer release) are
    reported, never silently dropped, whatever else the pass concluded."""
    found = tuple(unknown_fields(cr))
    cond = (Condition("SpecWarnings", "True", "UnknownFields", "unknown fields: " + "; ".join(found)) if found
            else Condition("SpecWarnings", "False", "NoWarnings", ""))
    generation = int((cr.get("metadata") or {}).get("generation") or 0)
    status = dict(result.status)
    status["conditions"] = merge_conditions(status.get("conditions") or [], [cond], _now(), generation)
    return replace(result, status=status, warnings=found)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _failed(cr: dict[str, Any], reason: str, message: str, error: Exception) -> SyncResult:
    meta, previous = cr.get("metadata") or {}, cr.get("status") or {}
    status = invalid_status(previous, int(meta.get("generation") or 0), reason, message, _now())
    return SyncResult(status, error)  # type: ignore[arg-type]


def _fingerprint(children: list[dict[str, Any]]) -> str:
    return hashlib.sha256(json.dumps(children, sort_keys=True).encode()).hexdigest()


def _kind(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["apiVersion"], obj["kind"]


def _no_crd(exc: ApiError, kind: tuple[str, str]) -> bool:
    """The API server has no such resource: for an apply (which creates what is absent) or a list,
    a 404 can mean nothing else. Only the optional kinds may be missing; a core kind's 404 is an error."""
    return exc.status == 404 and kind in OPTIONAL_KINDS


async def _apply_all(api: KubeApi, children: list[dict[str, Any]], memory: ServiceMemory,
                     force: bool) -> None:
    fingerprint, now = _fingerprint(children), time.monotonic()
    fresh = not force and fingerprint == memory.applied and now - memory.applied_at < RESYNC_S
    # A kind whose CRD was missing is tried on every pass, so installing the CRDs heals the
    # service without an edit; otherwise an unchanged set is not re-applied until RESYNC_S.
    todo = [c for c in children if not fresh or _kind(c) in memory.missing_kinds]
    missing: dict[tuple[str, str], None] = {}
    for child in todo:
        try:
            await api.apply(child)
        except ApiError as exc:
            if not _no_crd(exc, _kind(child)):
                raise
            missing[_kind(child)] = None  # the rest still applies; status says what is missing
    memory.missing_kinds = tuple(missing)
    if not fresh:
        memory.applied, memory.applied_at = fingerprint, now


async def prune(api: KubeApi, svc: ServiceSpec, children: list[dict[str, Any]],
                draining: Sequence[gens.Generation] = ()) -> list[str]:
    """Delete children this CR owns that reconcile no longer wants (e.g. after an operator upgrade),
    except those of an old generation still draining, which retire() removes."""
    wanted = {(c["kind"], c["metadata"]["name"]) for c in children}
    wanted |= {(kind, name) for g in draining for _, kind, name in g.children(svc.name)}
    removed = []
    for api_version, kind in CHILD_KINDS:
        try:
            found = await api.list(api_version, kind, svc.namespace, names.selector_labels(svc.name))
        except ApiError as exc:
            if not _no_crd(exc, (api_version, kind)):
                raise
            continue  # no CRD, so nothing of that kind to prune
        for obj in found:
            name = obj["metadata"]["name"]
            if (kind, name) not in wanted and is_owned_by(obj, svc.uid):
                await api.delete(api_version, kind, svc.namespace, name)
                removed.append(f"{kind}/{name}")
    return removed


async def _prefer_idle_pods(api: KubeApi, svc: ServiceSpec, gen: gens.Generation | None,
                           new: tuple[int, int], memory: ServiceMemory, logger: Any) -> None:
    """Ahead of a scale-down, rank the role's pods by load so the idlest go (scaling/deletion_cost.py)."""
    if gen is None or memory.scrape is None:
        return
    for role, index in gens.ROLE_INDEX.items():
        dep = gen.deployments.get(role) or {}
        if int((dep.get("spec") or {}).get("replicas") or 0) <= new[index]:
            continue
        try:
            pods = await api.list("v1", "Pod", svc.namespace, dep["spec"]["selector"]["matchLabels"])
            marked = await deletion_cost.mark(api, svc.namespace, pods, memory.scrape.loads(role))
        except ApiError as exc:  # a preference, never a reason to hold the scale-down
            if exc.transient:
                raise
            logger.warning(f"pod-deletion-cost not set: {exc}")
            continue
        if marked:
            logger.info(f"{role}: pod-deletion-cost set on {marked} pods ahead of a scale-down")


async def _hpas(api: KubeApi, svc: ServiceSpec) -> list[dict[str, Any]]:
    try:
        return await api.list("autoscaling/v2", "HorizontalPodAutoscaler", svc.namespace, {})
    except ApiError as exc:  # an older chart without the RBAC: no conflict detection, no failure
        if exc.transient:
            raise
        return []


async def _generations(api: KubeApi, svc: ServiceSpec) -> dict[str, gens.Generation]:
    return gens.group(await gens.list_worker_deployments(api, svc.namespace, svc.name), svc.uid)


def _rollout_step(svc: ServiceSpec, replicas: RoleReplicas, current: str,
                  found: dict[str, gens.Generation], old: list[gens.Generation]) -> Step:
    new = found[current].counts() if current in found else GenCounts(current, (0, 0), (0, 0))
    return step((replicas.prefill, replicas.decode), new, [g.counts() for g in old], svc.rollout_of(names.PREFILL),
                svc.rollout_of(names.DECODE), svc.autoscaling.ratio_min, svc.autoscaling.ratio_max)


async def _observe(api: KubeApi, svc: ServiceSpec, current: str) -> tuple[dict[str, Any], ClusterView]:
    found = await _generations(api, svc)
    observed: dict[str, Any] = gens.observe_roles(found, current)
    observed[names.ROUTER] = observe_deployment(await api.get(
        "apps/v1", "Deployment", svc.namespace, names.role_name(svc.name, names.ROUTER)))
    old = gens.old_generations(found, current)
    try:
        pods = await api.list("v1", "Pod", svc.namespace, names.selector_labels(svc.name))
    except ApiError as exc:  # pods only add crash-loop detail to the status; never block on them
        if exc.transient:
            raise
        pods = []
    view = ClusterView(current, tuple((g.name, g.counts().replicas) for g in old),
                       tuple(d for g in found.values() for d in g.deployments.values()), pod_problems(pods),
                       worker_failures=worker_failures(pods))
    return observed, view


async def _converge(api: KubeApi, svc: ServiceSpec, replicas: RoleReplicas, current: str,
                    policy: OperatorPolicy, memory: ServiceMemory, logger: Any, *, timer: bool,
                    prune_strays: bool) -> list[dict[str, Any]]:
    """One rollout step: apply the current generation's children at the step's counts, scale
    and retire old generations, prune strays. Returns the children applied."""
    found = await _generations(api, svc)
    old = gens.old_generations(found, current)
    moved = _rollout_step(svc, replicas, current, found, old)
    children = desired_children(svc, replicas, current, policy, new=moved.new)
    await _prefer_idle_pods(api, svc, found.get(current), moved.new, memory, logger)
    await _apply_all(api, children, memory, force=not timer or not moved.done)
    await gens.scale_old(api, old, moved)
    for removed in await gens.retire(api, svc.namespace, svc.name, old):
        logger.info(f"retired {removed}")
    if prune_strays:
        for removed in await prune(api, svc, children, [g for g in old if not g.empty()]):
            logger.info(f"pruned {removed}")
    return children


async def _metrics(api: KubeApi, http: httpx.AsyncClient, svc: ServiceSpec, memory: ServiceMemory,
                   logger: Any) -> dict[str, Any]:
    # Metrics only steer scaling; failing to read them must never block applying the spec. Each
    # fetch has its own cap and deadline (scaling/bounded_fetch.py); the round as a whole has this one.
    try:
        async with asyncio.timeout(METRICS_ROUND_S):
            return await read_metrics(api, http, svc, memory)
    except (ApiError, httpx.HTTPError) as exc:
        logger.warning(f"metrics unavailable: {exc}")
    except TimeoutError:
        logger.warning(f"metrics unavailable: the round took over {METRICS_ROUND_S:g} s")
    return {}


async def sync(cr: dict[str, Any], api: KubeApi, http: httpx.AsyncClient, memory: ServiceMemory,
               logger: Any, *, autoscale: bool, prune_strays: bool,
               policy: OperatorPolicy = OperatorPolicy()) -> SyncResult:  # noqa: B008 (frozen)
    return _with_warnings(await _sync(cr, api, http, memory, logger, autoscale, prune_strays, policy), cr)


async def _sync(cr: dict[str, Any], api: KubeApi, http: httpx.AsyncClient, memory: ServiceMemory,
                logger: Any, autoscale: bool, prune_strays: bool, policy: OperatorPolicy) -> SyncResult:
    try:
        svc = parse_service(cr)
    except SpecError as exc:
        logger.warning(f"invalid spec: {exc}")
        return _failed(cr, "InvalidSpec", str(exc), kopf.PermanentError(f"invalid spec: {exc}"))
    refused = policy_problems(svc, policy)
    if refused:
        message = "; ".join(refused)
        logger.warning(f"spec refused by policy: {message}")
        return _failed(cr, "Forbidden", message, kopf.PermanentError(f"refused: {message}"))
    status_in: dict[str, Any] = dict(cr.get("status") or {})
    auto_section: dict[str, Any] = {}
    report = memory.report or ScalingReport(False, "Pending", "waiting for the first metrics round")
    if not svc.autoscaling.enabled:
        report = ScalingReport(False, "Disabled", "spec.autoscaling.enabled is false")
    try:
        scalers = await role_scaler.read_scalers(api, svc)
        external = {r: n for r in svc.autoscaling.external if (n := role_scaler.wanted(scalers[r])) is not None}
        if autoscale:
            result = plan(svc, status_in, await _metrics(api, http, svc, memory, logger), memory.scaler,
                          time.time(), memory.last_decision, external)
            memory.scaler, memory.measured, memory.report = result.state, result.measured, result.report
            report, auto_section = result.report, result.status
            memory.last_decision = auto_section.get("lastDecision", memory.last_decision)
            if auto_section:
                status_in["autoscaler"] = auto_section
        replicas: RoleReplicas = desired_replicas(svc, status_in, external)
        current = generation_of(svc)
        problem = await pd_secret.ensure(api, svc)  # before the pods that read it; never rewritten
        if problem is not None:
            return _failed(cr, "PDSecretInvalid", problem, kopf.PermanentError(problem))
        children = await _converge(api, svc, replicas, current, policy, memory, logger,
                                   timer=autoscale, prune_strays=prune_strays)
        observed, view = await _observe(api, svc, current)
        if not all(o.exists for o in observed.values()):  # someone deleted a Deployment: repair now
            await _apply_all(api, children, memory, force=True)
            observed, view = await _observe(api, svc, current)
        await role_scaler.write_scalers(api, svc, scalers, {names.PREFILL: replicas.prefill,
                                                            names.DECODE: replicas.decode}, observed)
        view = replace(view, conflicts=tuple(role_scaler.hpa_conflicts(svc, await _hpas(api, svc))),
                       missing_kinds=memory.missing_kinds)
    except ApiError as exc:
        if exc.transient:
            raise kopf.TemporaryError(f"Kubernetes API: {exc}", delay=RETRY_DELAY_S) from exc
        return _failed(cr, "ApplyFailed", f"the API server rejected a child: {exc}",
                       kopf.PermanentError(f"apply failed: {exc}"))
    status = build_status(svc, replicas, observed, memory.measured, report, status_in, _now(), view)
    if auto_section:
        status["autoscaler"] = auto_section
    elif not svc.autoscaling.enabled and "autoscaler" in status_in:
        status["autoscaler"] = None  # merge-patch null: drop the stale section once scaling is off
    return SyncResult(status)
