"""The P:D ratio search: equal to brute force everywhere, and cheap at 1000 replicas per role."""

from __future__ import annotations

import random

from operator_support import EXAMPLES_DIR, load_example

from tandem.operator.scaling.autoscale_round import plan
from tandem.operator.spec import pd_ratio
from tandem.operator.spec.pd_ratio import nearest_feasible, ratio_feasible, ratio_ok
from tandem.operator.spec.service_spec import parse_service


def _brute(wp: int, wd: int, pr: tuple[int, int], dr: tuple[int, int], lo: float, hi: float):
    best = None
    for p in range(pr[0], pr[1] + 1):
        for d in range(dr[0], dr[1] + 1):
            if ratio_ok(p, d, lo, hi):
                key = (abs(p - wp) + abs(d - wd), -(p + d), -d)
                if best is None or key < best[0]:
                    best = (key, (p, d))
    return None if best is None else best[1]


def test_search_equals_brute_force() -> None:
    rng = random.Random(7)
    for _ in range(3000):
        pr = tuple(sorted((rng.randint(0, 12), rng.randint(0, 12))))
        dr = tuple(sorted((rng.randint(0, 12), rng.randint(0, 12))))
        lo = rng.choice([0.1, 0.25, 1 / 3, 0.5, 1.0])
        hi = lo * rng.choice([1, 1.5, 2, 4, 10])
        wp, wd = rng.randint(-2, 15), rng.randint(-2, 15)
        assert nearest_feasible(wp, wd, pr, dr, lo, hi) == _brute(wp, wd, pr, dr, lo, hi)
        assert ratio_feasible(pr, dr, lo, hi) == any(
            ratio_ok(p, d, lo, hi) for p in range(max(1, pr[0]), pr[1] + 1) for d in range(max(1, dr[0]), dr[1] + 1))


def test_zero_pair_is_allowed_only_together() -> None:
    assert ratio_ok(0, 0, 0.25, 1.0)
    assert not ratio_ok(0, 3, 0.25, 1.0) and not ratio_ok(2, 0, 0.25, 1.0)
    assert nearest_feasible(0, 0, (0, 4), (0, 8), 0.25, 1.0) == (0, 0)
    assert nearest_feasible(0, 5, (0, 4), (0, 8), 0.25, 1.0) == (2, 5)


def test_plan_at_1000_replicas_does_linear_work(monkeypatch) -> None:
    """maxReplicas 1000 on both roles: parsing and one autoscaling round stay far from the
    1000 x 1000 pair scan (counted in ratio checks, not timed: no timings in unit tests)."""
    cr = load_example(EXAMPLES_DIR / "inferenceservice-autoscaling.yaml")
    for role in ("prefill", "decode"):
        cr["spec"][role].update({"minReplicas": 1, "maxReplicas": 1000, "replicas": 1})
    cr["spec"]["autoscaling"]["ratio"] = {"min": 0.001, "max": 0.002}  # feasible only at large D
    calls = 0
    real = pd_ratio.ratio_ok

    def counting(*args: object) -> bool:
        nonlocal calls
        calls += 1
        return real(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(pd_ratio, "ratio_ok", counting)
    svc = parse_service(cr)
    result = plan(svc, {}, {}, None, now=1000.0)
    assert result.state is not None and result.state.decode.replicas >= 500
    assert calls < 20_000, calls
