"""Reserving a transfer's room on decode (the prealloc stage of decode/receiver.py): the pages
prefill writes, a first-token slot, a request row and the head-slice staging pages
(decode/staging.py), all or nothing, against what the running batch will still need."""

from __future__ import annotations

from typing import TYPE_CHECKING

from tandem.decode.incoming import Incoming
from tandem.decode.staging import ScatterStaging
from tandem.pd.transfer.first_token import FirstTokenSlots
from tandem.pd.transfer.head_map import Staging

if TYPE_CHECKING:
    from tandem.engine.scheduler.role_part import Host


def room_needed(host: Host, staging: ScatterStaging, plan: Staging, inc: Incoming) -> float:
    """KV tokens `inc` takes on decode (its prefix matched): its prompt's new pages, the staging
    for them, and what its decode is expected to add, never more than the pages its whole answer
    can fill (a prompt that ends a page short of a small pool must not wait for a page it will
    not use)."""
    req, cache, cfg = inc.req, host.cache, host.config
    P, n, skip = cache.page_size, len(req.origin_input_ids), len(req.prefix_indices)
    pages = cache.pages_needed(skip, n - skip)
    decode = min(req.sampling_params.max_new_tokens, cfg.clip_max_new_tokens)
    expected = pages * P + decode * host.new_token_ratio
    return min(expected, cache.pages_needed(skip, n - skip + decode) * P) + staging.pages_needed(plan, pages) * P


def reserve_room(host: Host, slots: FirstTokenSlots, staging: ScatterStaging, plan: Staging,
                 inc: Incoming, need: float) -> bool:
    """Take the room for `inc` (its prefix matched by the caller, locked here; `need` its
    room_needed), recorded in inc.slot, inc.pages and inc.staging; False, taking nothing, while
    the pool is short."""
    req, cache, P = inc.req, host.cache, host.cache.page_size
    if host.kv_headroom() < need or not slots.free or cache.free_rows() == 0:
        return False
    # Locking the matched prefix takes it out of the evictable pool the headroom counted (a prefix
    # the host tier just loaded back is all of that): check again with the lock held.
    cache.lock(req.last_node)
    if host.kv_headroom() < need:
        cache.unlock(req.last_node)
        return False
    taken = cache.alloc_extend([req])
    cache.settle_copies()  # the transfer writes these pages, and the prefix loaded back must be in
    inc.slot = slots.alloc()
    inc.pages = (taken[::P] // P).tolist()  # skip is page-aligned: slot 0 starts a page
    inc.staging = staging.reserve(plan, len(inc.pages))
    return True
