"""Replaying a load trace against the scaling policy, with a fluid model of a PD deployment.

Deterministic (seeded noise), second-by-second, no I/O: the autoscaler's simulation
tests use it, and so can anyone tuning targets or windows offline.

Model, per second (both roles are slot-limited servers, as continuous batching is):
  prefill         Q += rate; R -= R / prefill_seconds; admit min(Q, free prefill slots) into R
  decode          W += prefill completions; A -= A / decode_seconds; admit min(W, free KV slots)
  load per pod    (Q + R) / ready prefill pods     (the queueDepth signal: waiting + running)
  TTFT p95        base + prefill_seconds + Q / prefill rate + W / decode admission rate
  KV utilisation  A / (ready_decode * slots);  ITL p95 = itl_base * (1 + 1.5 * util)
New pods turn ready `startup_s` after the decision; removed pods leave at once.
A role with no ready pod reports no signal; the requests it holds up are its `pending`
demand, as the router exports it (scale from zero).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.operator.scaling.decision import Observation, Policy, ScalerState, decide, initial_state

INF_LATENCY_S = 60.0


@dataclass(frozen=True)
class ClusterModel:
    prefill_slots_per_pod: int = 4
    prefill_seconds_per_request: float = 1.0
    decode_slots_per_pod: int = 64
    decode_seconds_per_request: float = 8.0
    base_ttft_s: float = 0.3
    itl_base_s: float = 0.02
    startup_s: float = 60.0
    noise: float = 0.0  # relative, uniform, applied to every observed signal
    seed: int = 0


@dataclass(frozen=True)
class Tick:
    t: float
    rate: float
    prefill: int  # desired (decided) pods
    decode: int
    prefill_ready: int
    decode_ready: int
    ttft_p95_s: float
    itl_p95_s: float
    queue_per_pod: float
    kv_utilization: float
    completed: float = 0.0  # requests finished so far


@dataclass
class _Pool:
    ready_at: list[float] = field(default_factory=list)

    def resize(self, n: int, now: float, startup_s: float) -> None:
        while len(self.ready_at) < n:
            self.ready_at.append(now + startup_s)
        # Remove not-yet-ready pods first: that is what a Deployment scale-down does.
        self.ready_at.sort()
        del self.ready_at[n:]

    def ready(self, now: float) -> int:
        return sum(1 for t in self.ready_at if t <= now)


def _wait(backlog: float, rate: float) -> float:
    return backlog / rate if rate > 0 else INF_LATENCY_S


def _signal(name: str, queue: float, util: float, ttft: float, itl: float) -> float:
    return {"queueDepth": queue, "kvUtilization": util, "ttftP95": ttft, "itlP95": itl}[name]


def simulate(policy: Policy, rate: Callable[[float], float], duration_s: float, model: ClusterModel,
             start: tuple[int, int], tick_s: float = 15.0) -> list[Tick]:
    rng = random.Random(model.seed)
    state: ScalerState = initial_state(*start)
    pools = (_Pool(), _Pool())
    pools[0].resize(start[0], -model.startup_s, model.startup_s)
    pools[1].resize(start[1], -model.startup_s, model.startup_s)
    queue = running = waiting = active = completed = 0.0
    ticks: list[Tick] = []
    t = 0.0
    while t < duration_s:
        ready_p, ready_d = pools[0].ready(t), pools[1].ready(t)
        arrivals = rate(t)
        queue += arrivals
        done = min(running, running / model.prefill_seconds_per_request)
        running -= done
        started = min(queue, max(0.0, ready_p * model.prefill_slots_per_pod - running))
        running, queue = running + started, queue - started
        waiting += done
        finished = active / model.decode_seconds_per_request
        active -= finished
        completed += finished
        admit = min(waiting, max(0.0, ready_d * model.decode_slots_per_pod - active))
        active, waiting = active + admit, waiting - admit
        ttft = model.base_ttft_s + model.prefill_seconds_per_request + _wait(
            queue, ready_p * model.prefill_slots_per_pod / model.prefill_seconds_per_request)
        ttft += _wait(waiting, ready_d * model.decode_slots_per_pod / model.decode_seconds_per_request)
        util = active / (ready_d * model.decode_slots_per_pod) if ready_d else 1.0
        itl = model.itl_base_s * (1 + 1.5 * util)
        per_pod = (queue + running) / ready_p if ready_p else queue
        if t % tick_s == 0:
            def noisy(x: float) -> float:
                return x * (1 + model.noise * (2 * rng.random() - 1))

            obs = Observation(
                prefill=noisy(_signal(policy.prefill.signal, per_pod, util, ttft, itl)) if ready_p else None,
                decode=noisy(_signal(policy.decode.signal, per_pod, util, ttft, itl)) if ready_d else None,
                prefill_pending=0.0 if ready_p else queue + running,
                decode_pending=0.0 if ready_d else queue + running + waiting,
            )
            state = decide(policy, state, obs, t).state
            pools[0].resize(state.prefill.replicas, t, model.startup_s)
            pools[1].resize(state.decode.replicas, t, model.startup_s)
        ticks.append(Tick(t, arrivals, state.prefill.replicas, state.decode.replicas, ready_p, ready_d,
                          ttft, itl, per_pod, util, completed))
        t += 1.0
    return ticks


def reversals(counts: list[int]) -> int:
    """How often a replica count changed direction (up then down, or down then up)."""
    steps = [b - a for a, b in zip(counts, counts[1:], strict=False) if b != a]
    return sum(1 for a, b in zip(steps, steps[1:], strict=False) if (a > 0) != (b > 0))
