"""A request's life, owned in one place: the registry of live requests, the verbs that move
them, and `retire`, the only place one ends.

    add --> queue_prefill --> prefill batches --> join_running --> decode steps --+
     |                                                                            |
     +--> a role part holds it (a PD room) --> queue_prefill | join_decoding      v
                                                         \\------------------> retire
                                                                      (HOLD) --> release_held

Every way out reaches `retire(req, reason, kv)`: a stop or length found in a result, a
client's abort, a timeout, a grammar that failed or cost too much, a failed batch, a PD
transfer that failed. It does, once (a second call is a no-op):

1. the finish fields: `finished_reason`, status FINISHED, `to_finish` cleared; the request
   leaves the waiting queue or the chunk slot (the running batch drops it at its next filter);
2. asks the role part (`RolePart.on_retire`) whether it holds the request: a prefill holds
   one whose KV it is still sending;
3. the KV: CACHE releases it into the prefix cache, DISCARD frees it uncached, HOLD (asked
   for by the caller or the part) keeps it, with its row and registry entry, until the holder
   calls `release_held`;
4. the metrics, counted once for every reason (SchedulerMetrics.on_finish);
5. the last output, queued once with the step's other outputs (OutputProcessor.flush): a
   prefill's answer goes out at its finish, not when its send settles;
6. the registry entry, unless held: `reqs` holds exactly the requests not yet settled, so
   the scheduler is idle when it is empty.

`end(req, reason)` is how anything outside a batch's results ends a request: one in a launched
batch or the running set ends at its next result (`to_finish`, where result processing
retires it, since the step in flight may still write its KV); any other is retired now.

This is also the host a role part is given (role_part.Host) in place of the scheduler: the
views it reads and these verbs, nothing else. Under tensor parallelism every rank calls them
alike, from the tick's inputs only.
"""

from __future__ import annotations

import queue
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.decode_manager import DecodeManager
from tandem.engine.scheduler.metrics import SchedulerMetrics
from tandem.engine.scheduler.output_processor import OutputProcessor, accept_grammar_token
from tandem.engine.scheduler.prefill_adder import reserved_tokens
from tandem.engine.scheduler.prefill_manager import PrefillManager
from tandem.engine.scheduler.req import FinishReason, KVFate, Req, ReqStatus
from tandem.engine.scheduler.schedule_batch import ScheduleBatch
from tandem.protocol.logprobs import LOGPROB_FLOOR

if TYPE_CHECKING:
    from tandem.engine.kvcache.memory_pool import TokenToKVPool
    from tandem.engine.parallel.group import TPGroup
    from tandem.engine.scheduler.role_part import RolePart

# In a launched batch or the running set: a step in flight may still write their KV.
_RUNNING = (ReqStatus.EXTENDING, ReqStatus.CHUNKED, ReqStatus.DECODING)


class Lifecycle:
    def __init__(self, config: EngineConfig, tp: TPGroup, dp_rank: int, inbox: queue.Queue | queue.SimpleQueue,
                 kv_pool: TokenToKVPool, vocab_size: int, cache: CacheManager, prefill: PrefillManager,
                 decode: DecodeManager, output: OutputProcessor, metrics: SchedulerMetrics) -> None:
        # Views a role part reads (role_part.Host).
        self.config, self.tp, self.dp_rank, self.inbox = config, tp, dp_rank, inbox
        self.kv_pool, self.vocab_size, self.cache = kv_pool, vocab_size, cache
        self.now = time.monotonic()  # this iteration's clock (under TP, rank 0's: parallel/tick.py)
        self.prefill, self.decode, self.output, self.metrics = prefill, decode, output, metrics
        self.part: RolePart | None = None
        self.reqs: dict[str, Req] = {}  # every request received and not yet settled
        self.received = 0  # requests ever registered: each is retired once (check_integrity)

    # ---- views -----------------------------------------------------------------------------------
    @property
    def new_token_ratio(self) -> float:
        return self.decode.new_token_ratio

    def kv_headroom(self) -> float:
        """KV tokens free or evictable beyond what the running batch is expected to need."""
        reserve = reserved_tokens(self.decode.reqs, self.decode.new_token_ratio, self.config.clip_max_new_tokens)
        return self.cache.available_tokens() - reserve

    # ---- joining ---------------------------------------------------------------------------------
    def add(self, req: Req) -> None:
        req.arrival_time = self.now
        self.reqs[req.rid] = req
        self.received += 1

    def queue_prefill(self, req: Req) -> None:
        self.prefill.add(req)

    def join_running(self, batch: ScheduleBatch, exclude: Req | None) -> None:
        """A prefill batch just processed: its requests (minus one still chunking) decode on."""
        batch.filter_batch(exclude=exclude)
        self.decode.running_batch.merge_batch(batch)

    def join_decoding(self, req: Req, token: int, logprob: float | None, top: list) -> None:
        """A request prefilled elsewhere (decode/receiver.py) joins the running batch with the
        first token its prefill sampled, or ends on it."""
        req.first_token_time = req.last_token_time = time.monotonic()
        req.output_ids.append(token)
        req.status = ReqStatus.DECODING
        if req.sampling_params.return_logprob or req.sampling_params.top_logprobs_num:
            # None: prefill was not asked for logprobs (a router that sent the two roles different
            # bodies). The floor, never NaN: every number a route emits is finite.
            req.logprobs.append(logprob if logprob is not None else LOGPROB_FLOOR)
            req.top_logprobs.append(top[: req.sampling_params.top_logprobs_num])
        # Prefill sampled the first token under the same grammar; this matcher, built from the
        # same constraint, catches up on it here and continues from it.
        reason = req.to_finish or accept_grammar_token(req, token) or self.output.check_finished(req, token)
        if reason is not None:
            self.retire(req, reason)
            return
        self.join_running(ScheduleBatch([req], output_ids=np.array([token], dtype=np.int64)), None)
        self.output.queue(req)

    # ---- ending ----------------------------------------------------------------------------------
    def end(self, req: Req, reason: FinishReason) -> bool:
        """End `req` from outside its results (see the module docstring). The first reason wins:
        False when it was ending already."""
        if req.finished() or req.to_finish is not None:
            return False
        if req.status in _RUNNING:
            req.to_finish = reason
        else:
            self.retire(req, reason)
        return True

    def retire(self, req: Req, reason: FinishReason, kv: KVFate = KVFate.CACHE) -> None:
        """The only place a request ends (see the module docstring)."""
        if req.finished():
            return
        was = req.status
        req.finished_reason, req.to_finish, req.status = reason, None, ReqStatus.FINISHED
        if self.prefill.chunked_req is req:
            self.prefill.chunked_req = None
        elif was in (ReqStatus.WAITING, ReqStatus.RETRACTED):
            self.prefill.remove(req)
        if kv is KVFate.DISCARD:
            self.cache.discard(req)
        held = self.part is not None and self.part.on_retire(req)  # the part ends its own state of it
        if kv is not KVFate.HOLD and not held:
            self.cache.release(req)  # a discarded request holds nothing: a no-op then
            self.reqs.pop(req.rid, None)
        self.metrics.on_finish(req)
        self.output.queue(req)

    def retire_all(self, reqs: list[Req], reason: FinishReason, kv: KVFate) -> None:
        with self.cache.free_group():
            for r in reqs:
                self.retire(r, reason, kv)

    def release_held(self, req: Req, kv: KVFate = KVFate.CACHE) -> None:
        """A held request's holder is done with its KV: it is cached (or discarded) and the
        request settled. Once: a request already settled is left alone."""
        if self.reqs.get(req.rid) is not req or not req.finished():
            return
        if kv is KVFate.DISCARD:
            self.cache.discard(req)
        self.cache.release(req)
        del self.reqs[req.rid]

    # ---- state -----------------------------------------------------------------------------------
    def settled(self) -> bool:
        return not self.reqs

    def held(self) -> int:
        """Requests finished but still held (their KV in a role part's hands)."""
        return sum(r.finished() for r in self.reqs.values())

    def check_integrity(self) -> None:
        """With nothing running: every request received was retired exactly once. Retire counts
        each in the metrics once and is the only thing that does; an ending that bypassed it
        leaves the count short, one that left a request registered fails the first check."""
        assert not self.reqs, f"{len(self.reqs)} requests still registered while idle"
        ended = sum(self.metrics.finished.values())
        assert ended == self.received, f"{self.received} requests received, {ended} retired"

    def status(self) -> dict[str, Any]:
        return {"received": self.received, "registered": len(self.reqs), "held": self.held(),
                "finished": dict(self.metrics.finished)}
