"""A small parser for the Prometheus text exposition format, and histogram quantiles.

Only what the autoscaler reads: untyped samples with labels, and `_bucket` series.
Quantiles interpolate linearly inside a bucket, as PromQL's histogram_quantile does.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?\s+(\S+)(?:\s+\d+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Buckets = dict[float, float]  # upper bound (le) -> cumulative count


@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float

    def label(self, key: str) -> str | None:
        return dict(self.labels).get(key)


def parse(text: str) -> list[Sample]:
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue  # tolerate what we do not understand rather than failing a whole scrape
        name, raw_labels, raw_value = match.groups()
        try:
            value = float(raw_value)
        except ValueError:
            continue
        labels = tuple(_LABEL.findall(raw_labels or ""))
        samples.append(Sample(name, labels, value))
    return samples


def values(samples: list[Sample], name: str) -> list[float]:
    return [s.value for s in samples if s.name == name and not math.isnan(s.value)]


def buckets(samples: list[Sample], name: str) -> Buckets:
    """Cumulative bucket counts of histogram `name`, summed over its label sets."""
    out: Buckets = {}
    for s in samples:
        if s.name != f"{name}_bucket":
            continue
        le = s.label("le")
        if le is None:
            continue
        try:
            bound = math.inf if le in ("+Inf", "Inf") else float(le)
        except ValueError:
            continue  # a pod's metrics are the tenant's image's: skip what is not a number
        out[bound] = out.get(bound, 0.0) + s.value
    return out


def add(a: Buckets, b: Buckets) -> Buckets:
    return {le: a.get(le, 0.0) + b.get(le, 0.0) for le in set(a) | set(b)}


def delta(current: Buckets, previous: Buckets | None) -> Buckets:
    """Counts observed since `previous`; a counter that went down means the pod restarted."""
    if not previous or any(current.get(le, 0.0) < count for le, count in previous.items()):
        return dict(current)
    return {le: count - previous.get(le, 0.0) for le, count in current.items()}


def quantile(q: float, hist: Buckets) -> float | None:
    """histogram_quantile(q, hist); None when the histogram holds no observations."""
    if not hist:
        return None
    bounds = sorted(hist)
    total = hist[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound in bounds:
        count = hist[bound]
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # the quantile lies above the highest finite bucket
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (count - lower_count)
        lower_bound, lower_count = bound, count
    return bounds[-1] if not math.isinf(bounds[-1]) else lower_bound
