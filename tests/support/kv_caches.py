"""A CacheManager over a bare KV pool (no scheduler): what the PD staging tests allocate from."""

from __future__ import annotations

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.radix_cache import create_prefix_cache
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.scheduler.cache_manager import CacheManager


def cache_over(pool: TokenToKVPool) -> CacheManager:
    table = ReqToTokenPool(4, 64, "cpu")
    return CacheManager(table, pool, create_prefix_cache(False, table, pool.allocator, pool.page_size))
