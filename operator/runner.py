"""Starting the operator: kopf's embedded run with our registry, config, peering and metrics.

Without a peering name kopf runs standalone: one replica, and the chart then uses a Recreate
rollout so two copies never overlap. With one, every replica joins kopf's peering object (a
ClusterKopfPeering when watching all namespaces, a KopfPeering per watched namespace) and only
the highest-priority live replica handles events; the others pause until it leaves (graceful
stop) or its keep-alive expires (kopf's lifetime, 60 s).

kopf pauses *every* replica when two share the highest priority, so identical Deployment pods
cannot use one fixed priority. The default priority therefore ranks replicas by start time,
oldest first: a standby that restarts, or a new pod during a rolling update, never takes over
from a leader that is still alive (the autoscaler's in-memory state stays with the leader).
All defaults are negative, so a developer's `kopf run --dev` (666) or any priority >= 0 given
with --priority still outranks the in-cluster replicas, as kopf's peering intends.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence

import kopf

from tandem.operator.handlers import OperatorConfig, register
from tandem.operator.telemetry import MEMO_KEY, Telemetry

PRIORITY_EPOCH_MS = 1_700_000_000_000  # keeps |priority| small: about 10^14 for decades to come
TIE_BREAK = 1000  # replicas started in the same millisecond differ in the last three digits


def default_priority(started_at: float | None = None, rng: random.Random | None = None) -> int:
    """A negative priority that is higher the earlier the replica started (see the module doc)."""
    started_ms = int((time.time() if started_at is None else started_at) * 1000)
    jitter = (rng or random.SystemRandom()).randrange(TIE_BREAK)
    return -((started_ms - PRIORITY_EPOCH_MS) * TIE_BREAK + jitter) - 1


def peering_kwargs(peering: str | None, priority: int | None) -> dict[str, object]:
    """kopf.run's peering arguments: standalone without a name, else the name and a priority."""
    if not peering:
        return {"standalone": True}
    return {"standalone": False, "peering_name": peering,
            "priority": default_priority() if priority is None else priority}


def run_operator(namespaces: Sequence[str], all_namespaces: bool, config: OperatorConfig,
                 liveness: str | None = None, verbose: bool = False, *, peering: str | None = None,
                 priority: int | None = None, metrics_port: int = 0) -> int:
    registry = kopf.OperatorRegistry()
    register(registry, config)
    kopf.configure(verbose=verbose)
    telemetry = Telemetry()
    telemetry.serve(metrics_port)  # a daemon thread; it dies with the process
    memo = kopf.Memo(config=config)
    memo[MEMO_KEY] = telemetry  # kopf copies the memo per object, shallowly: all share this one
    kopf.run(
        registry=registry,
        clusterwide=all_namespaces,
        namespaces=list(namespaces),
        liveness_endpoint=liveness,
        memo=memo,
        **peering_kwargs(peering, priority),  # type: ignore[arg-type]
    )
    return 0
