"""The operator's own Prometheus metrics (not the workers'): how reconciles go, how long they take.

One Telemetry per operator process, on a dedicated registry, so the metrics page shows only
these and never prometheus_client's process/GC defaults twice or another library's metrics.
The kopf handlers wrap their sync() call in `observe(...)`; that is all the instrumentation.

  tandem_operator_reconcile_total{handler,result}    result: ok | error | invalid
  tandem_operator_reconcile_duration_seconds{handler}
  tandem_operator_errors_total{kind}                 kind: invalid_spec | forbidden | apply_failed |
                                                           pd_secret_invalid | temporary | unexpected
  tandem_operator_services                           InferenceServices this replica has seen and not seen deleted
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator, Mapping
from typing import Any

import kopf
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

MEMO_KEY = "telemetry"
# Reconciles are API round-trips plus, on the timer, a metrics scrape of every worker pod.
BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Degraded reasons sync() writes for a spec it cannot act on (malformed, or refused by the
# operator's policy): the author's to fix, so result="invalid"; anything else permanent is an error.
INVALID_REASONS = frozenset({"InvalidSpec", "Forbidden"})
ERROR_KINDS = {"InvalidSpec": "invalid_spec", "Forbidden": "forbidden", "ApplyFailed": "apply_failed",
               "PDSecretInvalid": "pd_secret_invalid"}


def _degraded_reason(status: Mapping[str, Any]) -> str | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Degraded" and cond.get("status") == "True":
            return str(cond.get("reason") or "")
    return None


class Outcome:
    """What one handler call came to; the handler hands its SyncResult to `record`."""

    def __init__(self) -> None:
        self.result = "ok"
        self.error_kind: str | None = None

    def record(self, sync_result: Any) -> Any:
        """Classify a SyncResult (duck-typed: .error, .status) and return it unchanged."""
        error = getattr(sync_result, "error", None)
        if error is None:
            return sync_result
        reason = _degraded_reason(getattr(sync_result, "status", None) or {})
        if isinstance(error, kopf.TemporaryError):
            self.result, self.error_kind = "error", "temporary"
        elif reason in INVALID_REASONS:
            self.result, self.error_kind = "invalid", ERROR_KINDS[reason]
        else:
            self.result, self.error_kind = "error", ERROR_KINDS.get(reason or "", "unexpected")
        return sync_result

    def raised(self, exc: BaseException) -> None:
        self.result = "error"
        self.error_kind = "temporary" if isinstance(exc, kopf.TemporaryError) else "unexpected"


class Telemetry:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.reconciles = Counter("tandem_operator_reconcile", "Handler runs by outcome.",
                                  ["handler", "result"], registry=self.registry)
        self.duration = Histogram("tandem_operator_reconcile_duration_seconds", "Handler run time.",
                                  ["handler"], buckets=BUCKETS, registry=self.registry)
        self.errors = Counter("tandem_operator_errors", "Failed handler runs by cause.", ["kind"],
                              registry=self.registry)
        self.services = Gauge("tandem_operator_services", "InferenceServices known to this replica.",
                              registry=self.registry)
        self._known: set[tuple[str, str]] = set()

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:
        """Serve /metrics from a daemon thread; port 0 means no metrics endpoint."""
        if port:
            start_http_server(port, addr, registry=self.registry)

    def track(self, namespace: str, name: str) -> None:
        self._known.add((namespace, name))
        self.services.set(len(self._known))

    def forget(self, namespace: str, name: str) -> None:
        self._known.discard((namespace, name))
        self.services.set(len(self._known))

    @contextlib.contextmanager
    def observe(self, handler: str, namespace: str, name: str) -> Iterator[Outcome]:
        self.track(namespace, name)
        outcome, started = Outcome(), time.perf_counter()
        try:
            yield outcome
        except asyncio.CancelledError:
            raise  # the operator is stopping: neither a success nor a failure
        except Exception as exc:
            outcome.raised(exc)
            self._count(handler, outcome, started)
            raise
        self._count(handler, outcome, started)

    def _count(self, handler: str, outcome: Outcome, started: float) -> None:
        self.duration.labels(handler).observe(time.perf_counter() - started)
        self.reconciles.labels(handler, outcome.result).inc()
        if outcome.error_kind is not None:
            self.errors.labels(outcome.error_kind).inc()


_FALLBACK: Telemetry | None = None


def of(memo: Mapping[str, Any]) -> Telemetry:
    """The process's Telemetry from kopf's memo (the runner puts it there before kopf starts).

    Handlers called without one (unit tests) get a private instance that nothing serves.
    """
    global _FALLBACK
    found = memo.get(MEMO_KEY)
    if isinstance(found, Telemetry):
        return found
    if _FALLBACK is None:
        _FALLBACK = Telemetry()
    return _FALLBACK
