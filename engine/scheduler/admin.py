"""The scheduler's admin commands (each answered by one AdminResult): flushing the prefix
cache, and the load and KV-pool state the front's /metrics and /debug/pool read."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from tandem.protocol.messages import AdminResult, FlushCacheReq, StatusReq

if TYPE_CHECKING:
    from tandem.engine.parallel.group import TPGroup
    from tandem.engine.scheduler.cache_manager import CacheManager


class AdminView(Protocol):
    """What the admin commands read of the scheduler (scheduler.py satisfies it)."""

    tp: TPGroup
    dp_rank: int
    cache: CacheManager

    def idle(self) -> bool: ...

    def self_check_during_idle(self) -> None: ...

    def cache_changed(self) -> None: ...

    def load(self) -> dict[str, Any]:
        """Queue depths, metrics and the parts' own counters, for pool_state."""


def flush_cache(sched: AdminView, msg: FlushCacheReq) -> AdminResult:
    """Drop the prefix cache when idle; ok when the pool is whole (all free) afterwards."""
    if not sched.idle():
        return AdminResult(msg.rid, False, {"error": "busy: requests are running"})
    try:
        sched.cache.flush()
    except (AssertionError, RuntimeError) as exc:  # an admin call must never kill the scheduler
        return AdminResult(msg.rid, False, {"error": f"flush failed: {exc}"})
    sched.cache_changed()  # check the pool again
    info = pool_state(sched)
    whole = all(r["free_tokens"] == r["capacity_tokens"] for r in info["tp_ranks"])
    return AdminResult(msg.rid, info["free_tokens"] == info["capacity_tokens"] and whole, info)


def status(sched: AdminView, msg: StatusReq) -> AdminResult:
    return AdminResult(msg.rid, True, pool_state(sched))


def pool_state(sched: AdminView) -> dict[str, Any]:
    """Load and pool sizes; `whole` when idle (the idle integrity check, run once per
    idle period, passed: it raises otherwise), None while requests run."""
    idle = sched.idle()
    if idle:
        sched.self_check_during_idle()
    return {"tp_ranks": tp_pools(sched), **_pool_state(sched, idle)}


def tp_pools(sched: AdminView) -> list[dict[str, int]]:
    """Every tensor-parallel rank's own page counts (each rank's allocator and radix tree are
    its own, kept equal only by scheduling alike): a leak on a rank the front never hears
    from shows here. A collective: every rank runs the same admin command in the same tick."""
    mine = [sched.cache.allocator.available_size(), sched.cache.tree.total_size(), sched.cache.capacity_tokens()]
    return [dict(zip(("free_tokens", "cached_tokens", "capacity_tokens"), r)) for r in sched.tp.all_gather_ints(mine)]


def _pool_state(sched: AdminView, idle: bool) -> dict[str, Any]:
    return {
        "dp_rank": sched.dp_rank, "idle": idle, "whole": True if idle else None,
        "free_tokens": sched.cache.allocator.available_size(), "cached_tokens": sched.cache.tree.total_size(),
        "capacity_tokens": sched.cache.capacity_tokens(), "page_size": sched.cache.page_size,
        "kv_usage": sched.cache.usage(),
        "kv_dtype": str(sched.cache.kv_pool.dtype).removeprefix("torch."),
        "kv_scales": sched.cache.kv_pool.scales.digest(), **sched.load(), **_host_tier(sched),
    }


def _host_tier(sched: AdminView) -> dict[str, Any]:
    """The host tier's state (kvcache/host_tier.py), where there is one."""
    host, disk = getattr(sched.cache.tree, "host", None), getattr(sched.cache.tree, "disk", None)
    if host is None:
        return {}
    out: dict[str, Any] = {"host_tier": {"capacity_tokens": host.capacity_tokens, "used_tokens": host.used_tokens(),
                                         "cached_tokens": sched.cache.tree.host_size(), **host.stats.as_dict()}}
    if disk is not None:
        out["disk_tier"] = {"budget_bytes": disk.budget, "used_bytes": disk.used_bytes(), **disk.stats.as_dict()}
    return out
