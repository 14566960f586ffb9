"""The autoscaling policy: unit behaviour, then load-trace simulations (no oscillation, SLO recovery,
ratio kept, bounded steps)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tandem.operator.scaling.decision import (
    Observation,
    Policy,
    RolePolicy,
    ScalerState,
    decide,
    initial_state,
    nearest_feasible,
)
from tandem.operator.scaling.simulate import ClusterModel, Tick, reversals, simulate
from tandem.operator.spec.sections import StepRule

POLICY = Policy(
    prefill=RolePolicy("queueDepth", 3.0, 1, 10),
    decode=RolePolicy("kvUtilization", 0.7, 1, 12),
    ratio_min=0.5, ratio_max=2.0, tolerance=0.1,
    up=StepRule(stabilization_s=30, cooldown_s=60, max_step=2),
    down=StepRule(stabilization_s=300, cooldown_s=180, max_step=1),
)
TICK = 15.0


def run(policy: Policy, state: ScalerState, values: list[tuple[float | None, float | None]],
        t0: float = 0.0) -> list[ScalerState]:
    out = []
    for i, (p, d) in enumerate(values):
        state = decide(policy, state, Observation(p, d), t0 + i * TICK).state
        out.append(state)
    return out


def counts(states: list[ScalerState]) -> list[tuple[int, int]]:
    return [(s.prefill.replicas, s.decode.replicas) for s in states]


def test_within_tolerance_nothing_moves() -> None:
    states = run(POLICY, initial_state(2, 2), [(3.2, 0.65)] * 40)
    assert set(counts(states)) == {(2, 2)}


def test_scale_up_needs_a_sustained_window_then_steps_by_max_step() -> None:
    # Load per prefill pod at 3x target: the recommendation is 6 pods.
    states = run(POLICY, initial_state(2, 2), [(9.0, 0.7)] * 3)
    assert counts(states)[:2] == [(2, 2), (2, 2)]  # 0 s and 15 s: the 30 s window is not covered yet
    assert counts(states)[2] == (4, 2)  # at 30 s: +2, the max step


def test_a_single_spike_does_not_scale_up() -> None:
    states = run(POLICY, initial_state(2, 2), [(3.0, 0.7), (3.0, 0.7), (30.0, 0.7), (3.0, 0.7), (3.0, 0.7)])
    assert set(counts(states)) == {(2, 2)}


def test_scale_up_cooldown_spaces_consecutive_steps() -> None:
    states = run(POLICY, initial_state(2, 2), [(30.0, 0.7)] * 12)
    times = [i * TICK for i, (a, b) in enumerate(zip(states, states[1:], strict=False))
             if b.prefill.replicas > a.prefill.replicas]
    assert times and all(b - a >= 60 for a, b in zip(times, times[1:], strict=False))


def test_scale_down_waits_for_the_full_down_window_and_steps_by_one() -> None:
    states = run(POLICY, initial_state(6, 4), [(0.5, 0.2)] * 30)
    first_down = next(i for i, s in enumerate(states) if s.prefill.replicas < 6)
    assert first_down * TICK >= 300
    drops = [a.prefill.replicas - b.prefill.replicas for a, b in zip(states, states[1:], strict=False)]
    assert max(drops) <= 1


def test_down_cooldown_follows_any_recent_scale_event() -> None:
    state = initial_state(4, 4, last_up={"prefill": 100.0}, last_down={})
    states = run(POLICY, state, [(0.5, 0.7)] * 25, t0=110.0)
    first_down = next(i for i, s in enumerate(states) if s.prefill.replicas < 4)
    assert 110.0 + first_down * TICK - 100.0 >= 180


def test_missing_metrics_hold_the_counts() -> None:
    states = run(POLICY, initial_state(3, 3), [(None, None)] * 40)
    assert set(counts(states)) == {(3, 3)}


def test_bounds_clamp_even_a_runaway_signal() -> None:
    states = run(POLICY, initial_state(9, 6), [(100.0, 1.0)] * 60)
    assert max(p for p, _ in counts(states)) == 10 and max(d for _, d in counts(states)) == 12


def test_ratio_moves_the_other_role_within_its_step() -> None:
    # Prefill must grow; decode's own signal says shrink; the ratio cap 1.0 pulls decode up instead.
    policy = replace(POLICY, ratio_max=1.0)
    states = run(policy, initial_state(3, 3), [(9.0, 0.1)] * 8)
    for p, d in counts(states):
        assert 0.5 <= p / d <= 1.0
    assert counts(states)[-1][0] > 3 and counts(states)[-1][1] >= counts(states)[-1][0]


def test_nearest_feasible_prefers_more_capacity_on_ties() -> None:
    assert nearest_feasible(5, 1, (1, 10), (1, 10), 0.5, 2.0) in {(2, 1), (5, 3)}
    assert nearest_feasible(4, 4, (1, 10), (1, 10), 0.5, 2.0) == (4, 4)
    assert nearest_feasible(1, 1, (3, 3), (1, 1), 0.5, 2.0) is None


# --- simulations ------------------------------------------------------------------------------------

def step_load(t: float) -> float:
    return 6.0 if t < 600 else 20.0 if t < 2400 else 6.0


def ttft_recovered_after(ticks: list[Tick], start: float, target: float) -> float:
    """Seconds from `start` until TTFT p95 stays under target for the next 5 minutes."""
    window = 300
    for i, tk in enumerate(ticks):
        if tk.t >= start and all(x.ttft_p95_s <= target for x in ticks[i:i + window]):
            return tk.t - start
    return float("inf")


def assert_invariants(ticks: list[Tick], policy: Policy) -> None:
    for tk in ticks:
        assert policy.ratio_min - 1e-9 <= tk.prefill / tk.decode <= policy.ratio_max + 1e-9, tk
        assert policy.prefill.min_replicas <= tk.prefill <= policy.prefill.max_replicas
        assert policy.decode.min_replicas <= tk.decode <= policy.decode.max_replicas
    for a, b in zip(ticks, ticks[1:], strict=False):
        for before, after in ((a.prefill, b.prefill), (a.decode, b.decode)):
            assert -policy.down.max_step <= after - before <= policy.up.max_step


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_step_load_recovers_the_slo_without_oscillation(seed: int) -> None:
    ticks = simulate(POLICY, step_load, 4200, ClusterModel(noise=0.2, seed=seed), start=(2, 2))
    assert_invariants(ticks, POLICY)
    # A 3.3x load step is absorbed: TTFT p95 back under 2 s within 7 minutes (pods take 60 s to start).
    assert ttft_recovered_after(ticks, 600, target=2.0) <= 420
    # Up once, down once per role: one direction change each, no flapping.
    assert reversals([t.prefill for t in ticks]) <= 1
    assert reversals([t.decode for t in ticks]) <= 1
    # And the load drop is handed back: by the end, capacity is back near the starting size.
    assert ticks[-1].prefill <= 4 and ticks[-1].decode <= 3


def test_noisy_steady_load_settles_and_stays_put() -> None:
    ticks = simulate(POLICY, lambda t: 12.0, 7200, ClusterModel(noise=0.3, seed=7), start=(2, 2))
    assert_invariants(ticks, POLICY)
    settled = ticks[1800:]
    assert len({t.prefill for t in settled}) == 1 and len({t.decode for t in settled}) == 1
    assert max(t.ttft_p95_s for t in settled) <= 2.0


def test_prefill_heavy_load_is_held_inside_the_ratio() -> None:
    # Long prompts (4 s of prefill each): prefill wants far more pods than decode does.
    policy = replace(POLICY, ratio_max=1.5, prefill=RolePolicy("queueDepth", 3.0, 1, 12))
    model = ClusterModel(prefill_seconds_per_request=4.0, noise=0.1, seed=3)
    ticks = simulate(policy, lambda t: 6.0, 3600, model, start=(2, 2))
    assert_invariants(ticks, policy)
    assert any(abs(t.prefill / t.decode - 1.5) < 1e-9 for t in ticks)  # the cap was binding
    assert ticks[-1].decode >= ticks[-1].prefill / 1.5


def test_ttft_signal_drives_prefill_and_recovers_the_slo() -> None:
    policy = replace(POLICY, prefill=RolePolicy("ttftP95", 2.0, 1, 10))
    ticks = simulate(policy, step_load, 2400, ClusterModel(noise=0.1, seed=5), start=(2, 2))
    assert_invariants(ticks, policy)
    assert ttft_recovered_after(ticks, 600, target=2.0) <= 600
    assert reversals([t.prefill for t in ticks[:2400]]) <= 2


def test_without_stabilization_the_same_noise_flaps() -> None:
    """Negative control: the oscillation check is able to fail."""
    naive = replace(POLICY, tolerance=0.0, up=StepRule(0, 0, 10), down=StepRule(0, 0, 10))
    ticks = simulate(naive, lambda t: 12.0, 3600, ClusterModel(noise=0.3, seed=7), start=(2, 2))
    assert reversals([t.prefill for t in ticks]) + reversals([t.decode for t in ticks]) >= 10
