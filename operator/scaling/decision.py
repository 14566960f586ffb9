"""The autoscaling policy: a pure function from (policy, state, observation, now) to a decision.

Per role, one decision runs these stages in order:

| stage          | what it does                                                            |
|----------------|-------------------------------------------------------------------------|
| recommend      | HPA formula ceil(current * value / target), ignoring +-tolerance noise  |
| stabilize      | up: the lowest recommendation in force over the up window (sustained);  |
|                | down: the highest one over the down window; both need a full window     |
| cooldown       | no scale-up within up.cooldown of the last scale-up; no scale-down      |
|                | within down.cooldown of the last scale event of either direction        |
| step, bounds   | at most maxStep pods per decision, inside [minReplicas, maxReplicas]    |

Then both roles are projected together onto the nearest (prefill, decode) pair that
keeps lo <= P/D <= hi, searching only inside each role's step box so the ratio never
costs an unbounded jump. The ratio is a hard constraint: it may move a role that is
in cooldown. Recommendation history lives in memory; replicas and scale times are
persisted in the CR status by the caller.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tandem.operator.spec.pd_ratio import nearest_feasible
from tandem.operator.spec.sections import StepRule
from tandem.operator.spec.service_spec import ServiceSpec


@dataclass(frozen=True)
class RolePolicy:
    signal: str
    target: float
    min_replicas: int
    max_replicas: int


@dataclass(frozen=True)
class Policy:
    prefill: RolePolicy
    decode: RolePolicy
    ratio_min: float
    ratio_max: float
    tolerance: float
    up: StepRule
    down: StepRule

    @classmethod
    def from_spec(cls, svc: ServiceSpec) -> Policy:
        auto = svc.autoscaling

        return cls(
            prefill=RolePolicy(auto.prefill.signal, auto.prefill.target, svc.prefill.min_replicas,
                               svc.prefill.max_replicas),
            decode=RolePolicy(auto.decode.signal, auto.decode.target, svc.decode.min_replicas,
                              svc.decode.max_replicas),
            ratio_min=auto.ratio_min, ratio_max=auto.ratio_max, tolerance=auto.tolerance,
            up=auto.up, down=auto.down,
        )


@dataclass(frozen=True)
class RoleState:
    replicas: int
    history: tuple[tuple[float, int], ...] = ()  # (time, raw recommendation), oldest first
    last_up: float | None = None
    last_down: float | None = None


@dataclass(frozen=True)
class ScalerState:
    prefill: RoleState
    decode: RoleState


@dataclass(frozen=True)
class Observation:
    """Signal values per role (already per replica or a p95); None when no data arrived."""

    prefill: float | None
    decode: float | None
    # Requests the router holds because the role has no ready pod (scale from zero).
    prefill_pending: float = 0.0
    decode_pending: float = 0.0


@dataclass(frozen=True)
class Decision:
    state: ScalerState
    reasons: tuple[str, ...]

    @property
    def prefill(self) -> int:
        return self.state.prefill.replicas

    @property
    def decode(self) -> int:
        return self.state.decode.replicas


def clamp(value: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, value))


def recommend(current: int, value: float | None, policy: RolePolicy, tolerance: float) -> int:
    if value is None or current <= 0:
        return current
    ratio = value / policy.target
    if abs(ratio - 1.0) <= tolerance:
        return current
    return clamp(math.ceil(current * ratio - 1e-9), policy.min_replicas, policy.max_replicas)


def _in_force(history: tuple[tuple[float, int], ...], now: float, window: float) -> list[int] | None:
    """Recommendations in force during [now - window, now], or None if history does not span the window."""
    start = now - window
    if not history or history[0][0] > start:
        return None
    before = [rec for t, rec in history if t <= start]
    return [before[-1]] + [rec for t, rec in history if t > start]


def stabilize(current: int, history: tuple[tuple[float, int], ...], now: float,
              up: StepRule, down: StepRule) -> int:
    ups = _in_force(history, now, up.stabilization_s)
    if ups and min(ups) > current:
        return min(ups)
    downs = _in_force(history, now, down.stabilization_s)
    if downs and max(downs) < current:
        return max(downs)
    return current


History = tuple[tuple[float, int], ...]


def _prune(history: History, now: float, keep_s: float) -> History:
    # Keep the newest entry older than the horizon too: it was in force at the window start.
    older = [i for i, (t, _) in enumerate(history) if t < now - keep_s]
    return history[older[-1]:] if older else history


def _propose(policy: RolePolicy, state: RoleState, value: float | None, now: float,
             pol: Policy, pending: float = 0.0) -> tuple[int, RoleState]:
    current = clamp(state.replicas, policy.min_replicas, policy.max_replicas)
    if current == 0:
        # From zero no signal exists (no pods); demand is the router's held requests. Waking
        # skips the windows and cooldowns: each second there is a client waiting.
        return (min(1, policy.max_replicas) if pending > 0 else 0), replace(state, replicas=0)
    raw = recommend(current, value, policy, pol.tolerance)
    keep = max(pol.up.stabilization_s, pol.down.stabilization_s)
    history = _prune(state.history + ((now, raw),), now, keep)
    wanted = stabilize(current, history, now, pol.up, pol.down)
    last_any = max((t for t in (state.last_up, state.last_down) if t is not None), default=None)
    if wanted > current and state.last_up is not None and now - state.last_up < pol.up.cooldown_s:
        wanted = current
    if wanted < current and last_any is not None and now - last_any < pol.down.cooldown_s:
        wanted = current
    wanted = clamp(wanted, current - pol.down.max_step, current + pol.up.max_step)
    return wanted, replace(state, replicas=current, history=history)


def project_ratio(want_p: int, want_d: int, cur_p: int, cur_d: int, pol: Policy) -> tuple[int, int]:
    def box(cur: int, role: RolePolicy) -> tuple[int, int]:
        lo, hi = cur - pol.down.max_step, cur + pol.up.max_step
        return max(role.min_replicas, lo), min(role.max_replicas, hi)

    found = nearest_feasible(want_p, want_d, box(cur_p, pol.prefill), box(cur_d, pol.decode),
                             pol.ratio_min, pol.ratio_max)
    if found is None:  # current pair already violates the ratio (e.g. the range was just edited)
        found = nearest_feasible(
            want_p, want_d, (pol.prefill.min_replicas, pol.prefill.max_replicas),
            (pol.decode.min_replicas, pol.decode.max_replicas), pol.ratio_min, pol.ratio_max)
    return found if found is not None else (want_p, want_d)


def _moved(state: RoleState, new: int, now: float) -> RoleState:
    if new > state.replicas:
        return replace(state, replicas=new, last_up=now)
    if new < state.replicas:
        return replace(state, replicas=new, last_down=now)
    return state


def _reason(role: str, old: int, new: int, wanted: int, value: float | None, policy: RolePolicy) -> str:
    why = "no metrics" if value is None else f"{policy.signal} {value:.3g} vs target {policy.target:g}"
    if old == 0 and new > 0:
        why = "requests waiting at the router (scale from zero)"
    via = "" if new == wanted else f" (ratio moved it from {wanted})"
    return f"{role} {old}->{new}: {why}{via}"


def decide(pol: Policy, state: ScalerState, obs: Observation, now: float) -> Decision:
    want_p, pre = _propose(pol.prefill, state.prefill, obs.prefill, now, pol, obs.prefill_pending)
    want_d, dec = _propose(pol.decode, state.decode, obs.decode, now, pol, obs.decode_pending)
    new_p, new_d = project_ratio(want_p, want_d, pre.replicas, dec.replicas, pol)
    reasons = tuple(
        _reason(role, old.replicas, new, wanted, value, rp)
        for role, old, new, wanted, value, rp in (
            ("prefill", pre, new_p, want_p, obs.prefill, pol.prefill),
            ("decode", dec, new_d, want_d, obs.decode, pol.decode),
        )
        if new != old.replicas
    )
    return Decision(ScalerState(_moved(pre, new_p, now), _moved(dec, new_d, now)), reasons)


def initial_state(prefill: int, decode: int, last_up: dict[str, float | None] | None = None,
                  last_down: dict[str, float | None] | None = None) -> ScalerState:
    ups, downs = last_up or {}, last_down or {}
    return ScalerState(
        RoleState(prefill, last_up=ups.get("prefill"), last_down=downs.get("prefill")),
        RoleState(decode, last_up=ups.get("decode"), last_down=downs.get("decode")),
    )
