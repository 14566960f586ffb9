"""The prefill:decode ratio: which (P, D) pairs are allowed, and the allowed pair nearest a wish.

A pair is allowed when lo <= P/D <= hi, or when both roles are at zero (a service scaled to
zero). For a fixed P > 0 the allowed D form one interval, [P/hi, P/lo], so a search walks P
outward from the wished P and takes the clamp of the wished D into that interval: O(P range)
at worst, and it stops as soon as |P - wished P| exceeds the best distance found, which keeps
kopf's event loop free even at maxReplicas 10000 on both roles.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

# Keeps e.g. 3 / 12 == 0.25 inside a [0.25, ...] range despite float rounding.
_EPS = 1e-9

Pair = tuple[int, int]


def ratio_ok(prefill: int, decode: int, lo: float, hi: float) -> bool:
    if prefill == 0 and decode == 0:
        return True
    return decode > 0 and lo - _EPS <= prefill / decode <= hi + _EPS


def decode_interval(p: int, d_range: Pair, lo: float, hi: float) -> Pair | None:
    """The D in d_range allowed with this P (P > 0), as (first, last), or None."""
    first = max(d_range[0], 1, math.floor(p / hi))
    last = min(d_range[1], math.ceil(p / lo))
    # floor/ceil bracket the exact bounds; at most a step or two of nudging lands on them.
    while first <= last and not ratio_ok(p, first, lo, hi):
        first += 1
    while last >= first and not ratio_ok(p, last, lo, hi):
        last -= 1
    return (first, last) if first <= last else None


def _best_for(p: int, want_d: int, d_range: Pair, lo: float, hi: float) -> int | None:
    if p == 0:
        return 0 if d_range[0] <= 0 else None
    interval = decode_interval(p, d_range, lo, hi)
    return None if interval is None else min(max(want_d, interval[0]), interval[1])


def _outward(center: int, first: int, last: int) -> Iterator[int]:
    """first..last ordered by distance from center, ties to the larger value (more pods)."""
    center = min(max(center, first), last)
    yield center
    for step in range(1, last - first + 1):
        for p in (center + step, center - step):
            if first <= p <= last:
                yield p
        if center + step > last and center - step < first:
            return


def nearest_feasible(want_p: int, want_d: int, p_range: Pair, d_range: Pair,
                     lo: float, hi: float) -> Pair | None:
    """The allowed (P, D) inside both ranges closest (L1) to what was wanted.

    Ties go to more pods (protecting the SLO), then to more decode pods.
    """
    best: tuple[tuple[int, int, int], Pair] | None = None
    for p in _outward(want_p, p_range[0], p_range[1]):
        if best is not None and abs(p - want_p) > best[0][0]:
            break
        d = _best_for(p, want_d, d_range, lo, hi)
        if d is None:
            continue
        key = (abs(p - want_p) + abs(d - want_d), -(p + d), -d)
        if best is None or key < best[0]:
            best = (key, (p, d))
    return None if best is None else best[1]


def ratio_feasible(p_range: Pair, d_range: Pair, lo: float, hi: float) -> bool:
    """Whether some pair with both roles serving (P, D >= 1) fits both ranges and the ratio."""
    return any(decode_interval(p, d_range, lo, hi) is not None
               for p in range(max(p_range[0], 1), p_range[1] + 1))
