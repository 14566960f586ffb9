"""The numbers a run is judged by: latency percentiles, throughput and goodput under an SLO,
and the ratios between two runs of one comparison."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.loadgen.client import Result

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")


@dataclass(frozen=True)
class Slo:
    ttft: float | None = None  # seconds
    tpot: float | None = None

    def met(self, r: Result) -> bool:
        if not r.ok:
            return False
        if self.ttft is not None and (r.ttft is None or r.ttft > self.ttft):
            return False
        return self.tpot is None or r.tpot is None or r.tpot <= self.tpot


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def samples(results: Sequence[Result], metric: str) -> list[float]:
    ok = [r for r in results if r.ok]
    if metric == "itl":
        return [x for r in ok for x in r.itl]
    values = [getattr(r, metric) for r in ok]
    return [v for v in values if v is not None]


def summarize(results: Sequence[Result], wall: float, slo: Slo = Slo()) -> dict:
    ok = [r for r in results if r.ok]
    out: dict = {
        "requests": len(results), "ok": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": wall,
        "request_throughput": len(ok) / wall if wall else 0.0,
        "input_token_throughput": sum(r.prompt_tokens for r in ok) / wall if wall else 0.0,
        "output_token_throughput": sum(r.output_tokens for r in ok) / wall if wall else 0.0,
        "goodput": sum(slo.met(r) for r in results) / wall if wall else 0.0,
        "slo": {"ttft_s": slo.ttft, "tpot_s": slo.tpot},
    }
    for metric in LATENCIES:
        xs = samples(results, metric)
        out[metric] = {f"p{q}": percentile(xs, q) for q in PERCENTILES}
        out[metric]["mean"] = sum(xs) / len(xs) if xs else None
    return out


# Ratios reported for a comparison: B over A. Above 1 is better for throughputs, worse for latencies.
RATIO_KEYS = ("request_throughput", "output_token_throughput", "goodput",
              "ttft.p50", "ttft.p99", "itl.p50", "tpot.p50", "e2e.p50", "e2e.p99")


def _get(summary: dict, key: str) -> float | None:
    value = summary
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value if isinstance(value, (int, float)) else None


def ratios(a: dict, b: dict) -> dict[str, float | None]:
    out = {}
    for key in RATIO_KEYS:
        x, y = _get(a, key), _get(b, key)
        out[key] = y / x if x and y is not None else None
    return out


def table(labels: Sequence[str], summaries: Sequence[dict]) -> str:
    """A plain-text table of the headline figures (ms for latencies), with B/A when two."""
    rows = [("requests ok", lambda s: f"{s['ok']}/{s['requests']}")]
    for key in RATIO_KEYS:
        scale = 1000 if "." in key else 1
        rows.append((key + (" ms" if scale == 1000 else ""),
                     lambda s, k=key, m=scale: "-" if _get(s, k) is None else f"{_get(s, k) * m:.2f}"))
    head = ["metric", *labels] + (["B/A"] if len(summaries) == 2 else [])
    lines = [head]
    for name, fmt in rows:
        line = [name, *(fmt(s) for s in summaries)]
        if len(summaries) == 2:
            r = ratios(*summaries).get(name.removesuffix(" ms"))
            line.append("-" if r is None else f"{r:.2f}x")
        lines.append(line)
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    return "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in lines)
