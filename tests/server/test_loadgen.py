"""The load generator's pure parts: workloads are deterministic and shaped as asked, and the
report's percentiles, goodput and ratios are right."""

from __future__ import annotations

import pytest

from tandem.loadgen.client import Result
from tandem.loadgen.report import Slo, percentile, ratios, summarize, table
from tandem.loadgen.workloads import WORKLOADS, WorkloadSpec, build


@pytest.mark.parametrize("kind", WORKLOADS)
def test_workloads_are_deterministic(kind):
    spec = WorkloadSpec(kind=kind, num=20, prompt=(4, 8), output=(2, 5), turns=3, context=50, prefix=16)
    a, b = build(spec), build(spec)
    assert a == b and len(a) == 20
    assert all(2 <= t.max_tokens <= 5 for s in a for t in s.turns) or kind == "sharegpt"
    if kind == "multi_turn":
        assert {len(s.turns) for s in a} == {3}
    if kind == "shared_prefix":
        assert 1 < len({s.system for s in a}) <= spec.tenants
    if kind == "long_context":
        assert all(len(s.turns[0].text.split()) == 50 for s in a)


def test_bad_specs():
    with pytest.raises(ValueError, match="workload"):
        WorkloadSpec(kind="nope")
    with pytest.raises(ValueError, match="prompt"):
        WorkloadSpec(prompt=(5, 2))


def test_percentile_matches_numpy_default():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert percentile(xs, 50) == 3.0 and percentile(xs, 90) == pytest.approx(4.6) and percentile([], 50) is None


def test_summary_goodput_and_ratios():
    fast = Result(ok=True, start=0, e2e=1.0, ttft=0.1, itl=[0.1] * 9, prompt_tokens=10, output_tokens=10)
    slow = Result(ok=True, start=0, e2e=3.0, ttft=2.0, itl=[0.1] * 9, prompt_tokens=10, output_tokens=10)
    failed = Result(ok=False, start=0, error="HTTP 500")
    s = summarize([fast, slow, failed], wall=2.0, slo=Slo(ttft=0.5))
    assert (s["ok"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500"])
    assert s["request_throughput"] == 1.0 and s["goodput"] == 0.5 and s["output_token_throughput"] == 10.0
    assert s["tpot"]["p50"] == pytest.approx((0.9 / 9 + 1.0 / 9) / 2)
    twice = summarize([fast, slow], wall=1.0)
    r = ratios(s, twice)
    assert r["request_throughput"] == 2.0 and r["ttft.p50"] == pytest.approx(1.0)
    assert "B/A" in table(["a", "b"], [s, twice])
