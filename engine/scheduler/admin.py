"""The scheduler's admin commands (each answered by one AdminResult): flushing the prefix
cache, and the load and KV-pool state the front's /metrics and /debug/pool read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tandem.protocol.messages import AdminResult, FlushCacheReq, StatusReq

if TYPE_CHECKING:
    from tandem.engine.scheduler.scheduler import Scheduler


def flush_cache(sched: Scheduler, msg: FlushCacheReq) -> AdminResult:
    """Drop the prefix cache when idle; ok when the pool is whole (all free) afterwards."""
    if not sched.idle():
        return AdminResult(msg.rid, False, {"error": "busy: requests are running"})
    try:
        sched.cache.flush()
    except (AssertionError, RuntimeError) as exc:  # an admin call must never kill the scheduler
        return AdminResult(msg.rid, False, {"error": f"flush failed: {exc}"})
    sched.idle_checked = False  # the cache changed: check the pool again
    info = pool_state(sched)
    return AdminResult(msg.rid, info["free_tokens"] == info["capacity_tokens"], info)


def status(sched: Scheduler, msg: StatusReq) -> AdminResult:
    return AdminResult(msg.rid, True, pool_state(sched))


def pool_state(sched: Scheduler) -> dict[str, Any]:
    """Load and pool sizes; `whole` when idle (the idle integrity check, run once per
    idle period, passed: it raises otherwise), None while requests run."""
    idle = sched.idle()
    if idle:
        sched.self_check_during_idle()
    return {
        "dp_rank": sched.dp_rank, "idle": idle, "whole": True if idle else None,
        "free_tokens": sched.cache.allocator.available_size(), "cached_tokens": sched.cache.tree.total_size(),
        "capacity_tokens": sched.cache.capacity_tokens(), "num_waiting": len(sched.prefill.waiting_queue),
        "num_running": sum(not r.finished() for r in sched.decode.reqs), "kv_usage": sched.cache.usage(),
        "metrics": sched.metrics.snapshot(),
        "pd": sched.part.status() if sched.part is not None else None,
        "grammar": sched.grammar.status(),
    }
