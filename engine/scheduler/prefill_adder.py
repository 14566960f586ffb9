"""PrefillAdder: decides which waiting requests fit into this round's prefill.

A fresh adder is built every scheduling round with four budgets:

    rem_total_tokens  KV the pool can still give out: free + evictable cache
                      - for each running request: min(max_new - generated, CLIP) * new_token_ratio
                      - for each request admitted this round: extend + min(max_new, CLIP)
    rem_input_tokens  max_prefill_tokens: new tokens computed in one forward
    rem_chunk_tokens  chunked_prefill_size: a longer request is cut page-aligned
                      and its remainder resumes first next round
    rem_rows          request rows free now: a newly admitted request takes one (rows
                      freed lately may still be held, see kvcache/req_table.py)

In a MIXED batch the running decode tokens are charged to the input and chunk
budgets up front.
"""

from __future__ import annotations

from enum import Enum

from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.req import Req


class AddReqResult(Enum):
    CONTINUE = "continue"  # room for more
    NO_TOKEN = "no_token"  # the KV budget is spent: stop admitting, the batch is full
    NO_ROW = "no_row"  # no request row is free: stop admitting until held rows are reclaimed
    OTHER = "other"  # this round's input/chunk budget is spent


def reserved_tokens(running: list[Req], new_token_ratio: float, clip: int) -> float:
    """KV the running requests are still expected to need (SGLang's reservation): each
    request's remaining max_new_tokens (clipped), times new_token_ratio."""
    return sum(min(max(r.sampling_params.max_new_tokens - len(r.output_ids), 0), clip) * new_token_ratio
               for r in running)


class PrefillAdder:
    def __init__(
        self,
        cache: CacheManager,
        running: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunk_size: int | None,
        clip_max_new_tokens: int,
        mixed_with_decode_tokens: int = 0,
    ) -> None:
        self.cache = cache
        self.page_size = cache.page_size
        self.clip = clip_max_new_tokens
        self.reserved = reserved_tokens(running, new_token_ratio, self.clip)
        self.rem_input_tokens = max_prefill_tokens - mixed_with_decode_tokens
        self.rem_chunk_tokens = None if chunk_size is None else chunk_size - mixed_with_decode_tokens
        self.rem_rows = cache.free_rows()
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self.log_hit_tokens = 0
        self.log_input_tokens = 0

    @property
    def rem_total_tokens(self) -> float:
        # Recomputed on demand: locking a request's prefix makes it non-evictable.
        return self.cache.available_tokens() - self.reserved

    def _ceil_page(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def budget_state(self) -> AddReqResult:
        if self.rem_total_tokens <= 0:
            return AddReqResult.NO_TOKEN
        if self.rem_rows <= 0:
            return AddReqResult.NO_ROW
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def _admit(self, req: Req, extend: int, max_new: int) -> None:
        self.can_run_list.append(req)
        if req.req_pool_idx is None:  # a chunked request keeps the row of its first chunk
            self.rem_rows -= 1
        self.reserved += self._ceil_page(extend) + max_new
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue a chunked request; returns it again if it still has chunks left."""
        budget = self.rem_input_tokens if self.rem_chunk_tokens is None else min(
            self.rem_input_tokens, self.rem_chunk_tokens)
        truncated = req.extend_input_len > budget
        if truncated:
            req.set_extend_input_len(budget // self.page_size * self.page_size)
            if req.extend_input_len <= 0:
                return req  # no room at all this round; it stays first in line
        self._admit(req, req.extend_input_len, 0 if truncated else self._max_new(req))
        return req if truncated else None

    def _max_new(self, req: Req) -> int:
        return min(max(req.sampling_params.max_new_tokens - len(req.output_ids), 0), self.clip)

    def add_one_req(self, req: Req) -> AddReqResult:
        if req.req_pool_idx is None and self.rem_rows <= 0:
            return AddReqResult.NO_ROW
        total = req.extend_input_len + self._max_new(req)
        if total >= self.rem_total_tokens:
            return AddReqResult.NO_TOKEN
        if self._ceil_page(req.extend_input_len) >= self.rem_input_tokens and self.can_run_list:
            return AddReqResult.OTHER
        # Locking the request's cached prefix takes it out of the evictable pool, so
        # the KV budget is checked again with the lock held.
        self.cache.lock(req.last_node)
        if total >= self.rem_total_tokens:
            self.cache.unlock(req.last_node)
            return AddReqResult.NO_TOKEN
        if self.rem_chunk_tokens is None or req.extend_input_len <= self.rem_chunk_tokens:
            self._admit(req, req.extend_input_len, self._max_new(req))
        else:
            trunc = self.rem_chunk_tokens // self.page_size * self.page_size
            if trunc <= 0:
                self.cache.unlock(req.last_node)
                return AddReqResult.OTHER
            req.set_extend_input_len(trunc)
            self.new_chunked_req = req
            self._admit(req, trunc, 0)
        self.log_hit_tokens += req.prefix_len
        self.log_input_tokens += req.extend_input_len
        # A chunk used up this round's chunk budget, and a batch carries one chunked request.
        return AddReqResult.OTHER if self.new_chunked_req is req else self.budget_state()
