"""Ratio-preserving rollout of a new model generation: pure steps, one per sync.

Prefill and decode pods pair only within a generation (the router and the KV handshake
both check it), so a new generation is useful only as a (P, D) pair whose ratio is in
range, and an old generation keeps serving only while it still has both roles. Each step:

  new gen   per role, grow into the surge room: min(target, new + (target + surge - all pods));
            then the allowed (P, D) nearest that wish, inside [0, wish] per role
  old gens  per role, drop unready pods, then as many ready ones as keep
            ready(all gens) >= target - maxUnavailable; then the allowed pair nearest that,
            removing no more than computed (never below availability), and no fewer than 0
  spread    the old generations' total is taken from the oldest first
  stalled   if nothing moved with every pod ready (no surge, one prefill pod), the old
            generation drops to its floor uncoupled: maxUnavailable already allows that pod

The counts come from the observed Deployments (level-based: no state outside the cluster).
Scaling an old Deployment down terminates pods through their preStop drain, so in-flight
requests finish: the old generation is drained, not cut. The classic Deployment rule is
the special case of one role; maxSurge rounds up and maxUnavailable down, as there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.operator.spec.pd_ratio import Pair, nearest_feasible, ratio_ok
from tandem.operator.spec.sections import Rollout


@dataclass(frozen=True)
class GenCounts:
    """One generation's worker Deployments as observed: spec replicas and ready pods."""

    generation: str
    replicas: Pair  # (prefill, decode)
    ready: Pair


@dataclass(frozen=True)
class Step:
    new: Pair
    old: dict[str, Pair]  # generation -> (prefill, decode) replicas
    done: bool  # no old generation has a pod left to remove


def budget(value: int | str, target: int, round_up: bool) -> int:
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * target / 100
    return math.ceil(share) if round_up else math.floor(share)


def _allowed(wish: Pair, box_lo: Pair, box_hi: Pair, lo: float, hi: float, coupled: bool) -> Pair:
    if not coupled:
        return wish
    found = nearest_feasible(wish[0], wish[1], (box_lo[0], box_hi[0]), (box_lo[1], box_hi[1]), lo, hi)
    return found if found is not None else box_hi


def _grow_new(target: Pair, new: GenCounts, old_total: Pair, surge: Pair) -> Pair:
    wish = []
    for r in (0, 1):
        room = max(0, target[r] + surge[r] - new.replicas[r] - old_total[r])
        wish.append(min(target[r], new.replicas[r] + room))
    return wish[0], wish[1]


def _shrink_old(target: Pair, new: GenCounts, old: list[GenCounts], unavailable: Pair) -> Pair:
    wish = []
    for r in (0, 1):
        replicas = sum(g.replicas[r] for g in old)
        ready = sum(g.ready[r] for g in old)
        unready = max(0, replicas - ready)
        spare = max(0, new.ready[r] + ready - (target[r] - unavailable[r]))
        wish.append(max(0, replicas - unready - spare))
    return wish[0], wish[1]


def _spread(total: Pair, old: list[GenCounts]) -> dict[str, Pair]:
    """Give the newest old generations their pods first: the oldest drains first."""
    left = list(total)
    out: dict[str, Pair] = {}
    for g in reversed(old):
        keep = (min(left[0], g.replicas[0]), min(left[1], g.replicas[1]))
        out[g.generation] = keep
        left = [left[0] - keep[0], left[1] - keep[1]]
    return out


def step(target: Pair, new: GenCounts, old: list[GenCounts], prefill: Rollout, decode: Rollout,
         lo: float, hi: float) -> Step:
    """The next (new, old) counts; `old` oldest first. lo/hi: the P:D range to keep."""
    old = [g for g in old if g.replicas != (0, 0) or g.ready != (0, 0)]
    if not old:
        return Step(target, {}, True)
    # The target itself must be allowed for the generations to move in pairs; otherwise
    # (a fixed P:D outside the autoscaler's range, a role at zero) each role steps alone.
    lo, hi = (min(lo, target[0] / target[1]), max(hi, target[0] / target[1])) if target[1] else (lo, hi)
    coupled = ratio_ok(target[0], target[1], lo, hi)
    rules = (prefill, decode)
    surge = tuple(budget(rules[r].max_surge, target[r], True) for r in (0, 1))
    unavailable = tuple(budget(rules[r].max_unavailable, target[r], False) for r in (0, 1))
    old_total = (sum(g.replicas[0] for g in old), sum(g.replicas[1] for g in old))
    wish_new = _grow_new(target, new, old_total, surge)  # type: ignore[arg-type]
    new_pair = _allowed(wish_new, (0, 0), wish_new, lo, hi, coupled)
    floor = _shrink_old(target, new, old, unavailable)  # type: ignore[arg-type]
    old_pair = _allowed(floor, floor, old_total, lo, hi, coupled)
    settled = new.ready == new.replicas and all(g.ready == g.replicas for g in old)
    if settled and new_pair == new.replicas and old_pair == old_total:
        # Stalled: with no surge, a lone prefill pod can only move once the old generation
        # gives it up, which breaks the old pair. maxUnavailable allows that pod to go, so the
        # old generation serves decode-only (short prompts) for a step rather than block.
        old_pair = floor
    spread = _spread(old_pair, old)
    return Step(new_pair, spread, old_pair == (0, 0) and new_pair == target)
