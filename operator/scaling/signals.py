"""From worker metrics to the per-role numbers the policy and the status read. Pure.

| signal        | value                                       | read from     |
|---------------|---------------------------------------------|---------------|
| queueDepth    | requests held per ready pod: waiting+running | both roles    |
| kvUtilization | mean tandem_kv_cache_usage over ready pods   | both roles    |
| ttftP95       | p95 of the TTFT histogram since last read    | prefill pods  |
| itlP95        | p95 of the ITL histogram since last read     | decode pods   |

queueDepth counts running requests as well as waiting ones on purpose: waiting-only depth
sits at zero whenever capacity exceeds load, so a proportional rule driven by it keeps
scaling down until a queue forms and then back up (the simulation tests show the flapping).
Waiting plus running is proportional to load (Little's law) and falls as pods are added.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem import metric_names as m
from tandem.operator.scaling import prometheus_text
from tandem.operator.scaling.prometheus_text import Buckets


@dataclass(frozen=True)
class PodMetrics:
    pod: str
    queue: float | None = None
    running: float | None = None
    kv_usage: float | None = None
    handshake: float | None = None
    ttft: Buckets = field(default_factory=dict)
    itl: Buckets = field(default_factory=dict)


@dataclass(frozen=True)
class RoleMetrics:
    pods: int = 0
    queue_per_replica: float | None = None
    kv_utilization: float | None = None
    ttft_p95_s: float | None = None
    itl_p95_s: float | None = None
    handshake_ok: bool | None = None
    pending: float = 0.0  # requests the routers hold for this role (no ready pod): scale from zero


def _one(samples: list[prometheus_text.Sample], name: str) -> float | None:
    found = prometheus_text.values(samples, name)
    return sum(found) if found else None


def pod_metrics(pod: str, text: str) -> PodMetrics:
    samples = prometheus_text.parse(text)
    return PodMetrics(
        pod=pod,
        queue=_one(samples, m.NUM_QUEUE_REQS),
        running=_one(samples, m.NUM_RUNNING_REQS),
        kv_usage=_one(samples, m.KV_CACHE_USAGE),
        handshake=_one(samples, m.KV_HANDSHAKE_OK),
        ttft=prometheus_text.buckets(samples, m.TIME_TO_FIRST_TOKEN_SECONDS),
        itl=prometheus_text.buckets(samples, m.INTER_TOKEN_LATENCY_SECONDS),
    )


def router_pending(text: str) -> dict[str, float]:
    """Requests one router holds per worker role for want of a ready pod (scale from zero).
    A router that waits for "colocated" workers in a PD service waits for decode ones."""
    out = {role: 0.0 for role in (m.ROUTER_ROLES[0], m.ROUTER_ROLES[1])}
    for sample in prometheus_text.parse(text):
        if sample.name == m.ROUTER_PENDING_REQUESTS:
            role = sample.label("role") or ""
            role = "decode" if role == "colocated" else role
            if role in out:
                out[role] += sample.value
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def role_metrics(current: list[PodMetrics], previous: dict[str, PodMetrics]) -> RoleMetrics:
    """Aggregate one role's pods; histograms count only what was observed since `previous`."""
    if not current:
        return RoleMetrics()
    queues = [(p.queue or 0.0) + (p.running or 0.0) for p in current
              if p.queue is not None or p.running is not None]
    ttft: Buckets = {}
    itl: Buckets = {}
    for pod in current:
        before = previous.get(pod.pod)
        ttft = prometheus_text.add(ttft, prometheus_text.delta(pod.ttft, before.ttft if before else None))
        itl = prometheus_text.add(itl, prometheus_text.delta(pod.itl, before.itl if before else None))
    handshakes = [p.handshake for p in current if p.handshake is not None]
    return RoleMetrics(
        pods=len(current),
        queue_per_replica=sum(queues) / len(current) if queues else None,
        kv_utilization=_mean([p.kv_usage for p in current if p.kv_usage is not None]),
        ttft_p95_s=prometheus_text.quantile(0.95, ttft),
        itl_p95_s=prometheus_text.quantile(0.95, itl),
        handshake_ok=any(h >= 1 for h in handshakes) if handshakes else None,
    )


def signal_value(signal: str, metrics: RoleMetrics) -> float | None:
    latency = signal in ("ttftP95", "itlP95")
    idle = metrics.pods > 0 and metrics.queue_per_replica == 0
    if latency and idle and signal_value_raw(signal, metrics) is None:
        return 0.0  # no requests since the last read: an idle role, which may scale down
    return signal_value_raw(signal, metrics)


def signal_value_raw(signal: str, metrics: RoleMetrics) -> float | None:
    return {
        "queueDepth": metrics.queue_per_replica,
        "kvUtilization": metrics.kv_utilization,
        "ttftP95": metrics.ttft_p95_s,
        "itlP95": metrics.itl_p95_s,
    }.get(signal)
