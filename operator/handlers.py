"""The kopf handlers. This module only registers thin functions; the work is in sync.py.

create / update / resume / timer all run the same level-based pass (per kopf's
reconciliation docs); the timer additionally reads metrics and autoscales.
Children carry ownerReferences, so the garbage collector removes them with the CR;
there is no deletion handler. kopf still puts one finalizer on each CR because it
stops timers through it; it is named tandem.dev/finalizer here.
Each sync() runs inside telemetry.observe(), which counts and times it for /metrics.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import httpx
import kopf

from tandem.operator import names, telemetry
from tandem.operator.kubeapi import KubeApi, credentials_from_kopf
from tandem.operator.scaling.autoscale_round import ServiceMemory
from tandem.operator.security.operator_policy import OperatorPolicy
from tandem.operator.sync import SyncResult, sync

RESOURCE = (names.GROUP, names.VERSION, names.PLURAL)
MEMORY_KEY = "tandem_service"


@dataclass(frozen=True)
class OperatorConfig:
    interval_s: float = 15.0
    initial_delay_s: float = 2.0
    metrics_timeout_s: float = 2.0
    # Fixed by the cluster admin at start-up (chart values), never read from a CR.
    policy: OperatorPolicy = OperatorPolicy()  # frozen: one shared default instance is safe


def login(settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(settings=settings) or kopf.login_with_kubeconfig(settings=settings)


async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, logger: Any, **_: Any) -> None:
    # Keep kopf's bookkeeping under our own annotation prefix, and out of status.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=names.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=names.GROUP, key="last-handled-configuration")
    settings.persistence.finalizer = f"{names.GROUP}/finalizer"
    settings.posting.level = logging.WARNING
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per API call otherwise
    info = login(settings=settings)
    if info is None:
        raise kopf.PermanentError("no in-cluster service account and no kubeconfig found")
    config = _config(memo)
    memo["api"] = KubeApi.connect(credentials_from_kopf(info))
    # Pod IPs and in-cluster Prometheus are never reached through an egress proxy.
    memo["http"] = httpx.AsyncClient(timeout=config.metrics_timeout_s, trust_env=False)
    logger.info(f"tandem operator talking to {info.server}")


async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    for key in ("api", "http"):
        client = memo.get(key)
        if client is not None:
            await client.aclose()


def _memory(memo: kopf.Memo) -> ServiceMemory:
    if MEMORY_KEY not in memo:
        memo[MEMORY_KEY] = ServiceMemory()
    return memo[MEMORY_KEY]


def _config(memo: kopf.Memo) -> OperatorConfig:
    config = memo.get("config")
    return config if isinstance(config, OperatorConfig) else OperatorConfig()


def _write(patch: kopf.Patch, result: SyncResult) -> None:
    for key, value in result.status.items():
        patch.status[key] = value


async def _sync(body: kopf.Body, memo: kopf.Memo, logger: Any, *, timer: bool) -> SyncResult:
    # The timer autoscales; create/update/resume prune strays (a list per child kind: not every tick).
    return await sync(dict(body), memo["api"], memo["http"], _memory(memo), logger,
                      autoscale=timer, prune_strays=not timer, policy=_config(memo).policy)


async def reconcile_handler(spec: kopf.Spec, name: str, namespace: str, logger: Any, body: kopf.Body,
                            memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
    with telemetry.of(memo).observe("reconcile", namespace, name) as outcome:
        result = outcome.record(await _sync(body, memo, logger, timer=False))
    _write(patch, result)
    if result.warnings:  # on create/update/resume only: the timer would repeat it every tick
        kopf.warn(body, reason="UnknownFields", message="; ".join(result.warnings)[:1000])
    if result.error is not None:
        raise result.error


async def timer_handler(spec: kopf.Spec, name: str, namespace: str, logger: Any, body: kopf.Body,
                        memo: kopf.Memo, patch: kopf.Patch, **_: Any) -> None:
    with telemetry.of(memo).observe("timer", namespace, name) as outcome:
        result = outcome.record(await _sync(body, memo, logger, timer=True))
    _write(patch, result)
    if isinstance(result.error, kopf.TemporaryError):
        raise result.error
    # A permanent problem is already in status (Degraded); the next tick re-checks it.


async def forget_handler(spec: kopf.Spec, name: str, namespace: str, logger: Any, memo: kopf.Memo,
                         **_: Any) -> None:
    memo.pop(MEMORY_KEY, None)
    telemetry.of(memo).forget(namespace, name)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    kopf.on.login(registry=registry)(login)
    kopf.on.startup(registry=registry)(startup)
    kopf.on.cleanup(registry=registry)(cleanup)
    for on in (kopf.on.create, kopf.on.update, kopf.on.resume):
        on(*RESOURCE, registry=registry, id="reconcile")(reconcile_handler)
    kopf.timer(*RESOURCE, registry=registry, id="timer", interval=config.interval_s,
               initial_delay=config.initial_delay_s)(timer_handler)
    kopf.on.delete(*RESOURCE, registry=registry, id="forget", optional=True)(forget_handler)
