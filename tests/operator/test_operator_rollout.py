"""Ratio-preserving rollouts: the pure step over many shapes (availability, surge, ratio and
convergence hold at every step), then whole rollouts through sync() against the API stand-in."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from operator_fake_api import FakeApiServer, run_sync

from tandem.operator import names
from tandem.operator.rollout.step import GenCounts, budget, step
from tandem.operator.spec.pd_ratio import ratio_ok
from tandem.operator.spec.sections import Rollout


def _drive(target: tuple[int, int], start: tuple[int, int], rule: Rollout, lo: float, hi: float,
           coupled: bool = True) -> int:
    """Run steps until done; pods become ready one step after they are asked for."""
    new, old = GenCounts("b", (0, 0), (0, 0)), GenCounts("a", start, start)
    surge = [budget(rule.max_surge, t, True) for t in target]
    unavailable = [budget(rule.max_unavailable, t, False) for t in target]
    for n in range(200):
        s = step(target, new, [old], rule, rule, lo, hi)
        if s.done:
            assert s.new == target and all(pair == (0, 0) for pair in s.old.values())
            return n
        o = s.old.get("a", (0, 0))
        for r in (0, 1):
            assert s.new[r] + o[r] <= max(target[r] + surge[r], start[r] + new.replicas[r]), (n, s)
            # Availability counts pods ready before this step that are kept.
            kept = min(o[r], old.ready[r]) + min(s.new[r], new.ready[r])
            assert kept >= min(target[r] - unavailable[r], old.ready[r] + new.ready[r]), (n, s)
        if coupled:
            # Without surge a lone prefill pod moves only by leaving the old pair decode-only.
            assert ratio_ok(*s.new, lo, hi) and (ratio_ok(*o, lo, hi) or surge == [0, 0]), (n, s)
        new = GenCounts("b", s.new, s.new)
        old = GenCounts("a", o, o)
    raise AssertionError("the rollout did not converge")


SHAPES = [(1, 1), (1, 4), (2, 2), (3, 8), (4, 2), (6, 12)]
RULES = [Rollout(1, 0), Rollout(0, 1), Rollout("25%", 0), Rollout(2, 1), Rollout("50%", "50%")]


@pytest.mark.parametrize("target", SHAPES)
@pytest.mark.parametrize("rule", RULES, ids=str)
def test_steps_keep_capacity_surge_and_ratio_and_converge(target: tuple[int, int], rule: Rollout) -> None:
    lo, hi = 0.25, 2.0
    steps = _drive(target, target, rule, lo, hi)
    assert steps <= 4 * sum(target) + 4


def test_scaling_during_a_rollout_still_converges() -> None:
    for start, target in itertools.product([(2, 2), (1, 4)], [(4, 4), (1, 2), (0, 0)]):
        _drive(target, start, Rollout(1, 0), 0.25, 2.0, coupled=False)


def test_nothing_old_means_done_at_target() -> None:
    s = step((3, 6), GenCounts("b", (1, 1), (1, 1)), [], Rollout(1, 0), Rollout(1, 0), 0.25, 1.0)
    assert s.done and s.new == (3, 6)


def test_old_generations_drain_oldest_first() -> None:
    new = GenCounts("c", (2, 2), (2, 2))
    oldest, newer = GenCounts("a", (1, 1), (1, 1)), GenCounts("b", (1, 1), (1, 1))
    s = step((2, 2), new, [oldest, newer], Rollout(1, 1), Rollout(1, 1), 0.5, 2.0)
    assert s.old["a"] == (0, 0) or sum(s.old["a"]) <= sum(s.old["b"])


# ---- through sync() ---------------------------------------------------------------------------


def _deployments(server: FakeApiServer) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for p, o in server.objects.items() if "/deployments/" in p}


def _become_ready(server: FakeApiServer) -> None:
    """What the Deployment controller and kubelet would do: every wanted pod runs and is ready."""
    for dep in _deployments(server).values():
        n = dep["spec"]["replicas"]
        dep["metadata"]["generation"] = 1
        dep["status"] = {"observedGeneration": 1, "replicas": n, "readyReplicas": n, "updatedReplicas": n}


def test_a_new_generation_rolls_out_in_pairs_and_the_old_one_is_retired(minimal_cr: dict[str, Any]) -> None:
    cr = copy.deepcopy(minimal_cr)
    cr["spec"]["prefill"] = {"replicas": 2}
    cr["spec"]["decode"] = {"replicas": 4}
    server = FakeApiServer()
    run_sync(server, cr)
    _become_ready(server)
    (old_gen,) = {d["metadata"]["labels"][names.LABEL_GENERATION] for d in _deployments(server).values()
                  if names.LABEL_GENERATION in d["metadata"]["labels"]}
    cr["spec"]["engine"] = {"pageSize": 32}  # incompatible KV layout: a new generation
    seen_progressing = False
    for _ in range(30):
        result = run_sync(server, cr)
        deps = _deployments(server)
        by_gen: dict[str, list[int]] = {}
        for dep in deps.values():
            gen = dep["metadata"]["labels"].get(names.LABEL_GENERATION)
            if gen:
                pair = by_gen.setdefault(gen, [0, 0])
                role = dep["metadata"]["labels"][names.LABEL_COMPONENT]
                pair[0 if role == "prefill" else 1] = dep["spec"]["replicas"]
        for p, d in by_gen.values():
            assert ratio_ok(p, d, 0.25, 4.0), by_gen  # each generation serves as a pair throughout
        progressing = next(c for c in result.status["conditions"] if c["type"] == "Progressing")
        if old_gen in by_gen:
            seen_progressing |= progressing["reason"] == "RollingOutGeneration"
        else:
            break
        _become_ready(server)
    assert seen_progressing and old_gen not in by_gen
    (new_gen,) = by_gen
    assert by_gen[new_gen] == [2, 4]
    assert result.status["rollout"] == {"generation": new_gen, "oldGenerations": []}
    leftovers = [p for p in server.objects if old_gen in p]
    assert leftovers == []  # its Deployments, ConfigMap and prefill Service are gone


def test_a_stuck_rollout_is_degraded_with_the_reason(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    run_sync(server, minimal_cr)
    for dep in _deployments(server).values():
        dep["status"] = {"conditions": [{"type": "Progressing", "status": "False",
                                         "reason": "ProgressDeadlineExceeded",
                                         "message": "ReplicaSet has timed out progressing."}]}
    result = run_sync(server, minimal_cr)
    conds = {c["type"]: c for c in result.status["conditions"]}
    assert conds["Progressing"]["status"] == "False"
    assert conds["Degraded"]["status"] == "True" and conds["Degraded"]["reason"] == "ProgressDeadlineExceeded"


def test_crash_looping_pods_make_it_degraded(minimal_cr: dict[str, Any]) -> None:
    server = FakeApiServer()
    run_sync(server, minimal_cr)
    pod = {"metadata": {"name": "llama3-8b-decode-x-1", "labels": names.selector_labels("llama3-8b", "decode")},
           "status": {"containerStatuses": [{"restartCount": 7, "state": {"waiting": {"reason": "CrashLoopBackOff"}}}]}}
    server.objects["/api/v1/namespaces/default/pods/llama3-8b-decode-x-1"] = pod
    result = run_sync(server, minimal_cr)
    degraded = next(c for c in result.status["conditions"] if c["type"] == "Degraded")
    assert degraded["reason"] == "PodsFailing" and "CrashLoopBackOff (7 restarts)" in degraded["message"]


def test_a_failed_kv_handshake_is_degraded() -> None:
    from tandem.operator.status import ClusterView, Measured, _stuck

    assert _stuck(ClusterView(), Measured(handshake_ok=False))[0] == "KVHandshakeFailed"
    assert _stuck(ClusterView(), Measured(handshake_ok=True)) is None


def test_deployments_from_before_generations_are_drained_as_an_old_generation(minimal_cr: dict[str, Any]) -> None:
    """An operator upgrade finds `<name>-prefill`/`-decode` without a generation label: they keep
    serving (and their `<name>-engine` ConfigMap stays) until the new generation took over."""
    server = FakeApiServer()
    owner = {"uid": minimal_cr["metadata"]["uid"], "controller": True}
    for role in ("prefill", "decode"):
        labels = names.selector_labels("llama3-8b", role)
        server.objects[f"/apis/apps/v1/namespaces/default/deployments/llama3-8b-{role}"] = {
            "metadata": {"name": f"llama3-8b-{role}", "namespace": "default", "labels": labels,
                         "ownerReferences": [owner], "generation": 1},
            "spec": {"replicas": 1, "selector": {"matchLabels": labels}},
            "status": {"observedGeneration": 1, "replicas": 1, "readyReplicas": 1, "updatedReplicas": 1}}
    legacy_config = "/api/v1/namespaces/default/configmaps/llama3-8b-engine"
    server.objects[legacy_config] = {"metadata": {"name": "llama3-8b-engine", "labels": names.selector_labels(
        "llama3-8b"), "ownerReferences": [owner]}}
    legacy = [p for p in server.objects if p.endswith(("/llama3-8b-prefill", "/llama3-8b-decode"))]
    result = run_sync(server, minimal_cr)
    assert all(p in server.objects for p in legacy) and legacy_config in server.objects
    assert result.status["rollout"]["oldGenerations"] == [{"generation": "", "prefill": 1, "decode": 1}]
    for _ in range(10):
        _become_ready(server)
        result = run_sync(server, minimal_cr)
        if not result.status["rollout"]["oldGenerations"]:
            break
    run_sync(server, minimal_cr)  # the next reconcile prunes what the old pods mounted
    assert not any(p in server.objects for p in legacy) and legacy_config not in server.objects
