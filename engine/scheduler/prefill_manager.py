"""PrefillManager: owns the waiting queue and the chunked request; builds prefill batches.
Requests leave it by being scheduled, or by ending (engine/scheduler/lifecycle.py)."""

from __future__ import annotations

from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.prefill_adder import AddReqResult, PrefillAdder
from tandem.engine.scheduler.req import Req, ReqStatus
from tandem.engine.scheduler.schedule_batch import ScheduleBatch
from tandem.engine.scheduler.schedule_policy import SchedulePolicy


class PrefillManager:
    def __init__(self, config: EngineConfig, cache: CacheManager, policy: SchedulePolicy) -> None:
        self.config = config
        self.cache = cache
        self.policy = policy
        self.waiting_queue: list[Req] = []
        self.chunked_req: Req | None = None

    def add(self, req: Req, front: bool = False) -> None:
        req.status = ReqStatus.WAITING if not req.is_retracted else ReqStatus.RETRACTED
        if front:
            self.waiting_queue.insert(0, req)
        else:
            self.waiting_queue.append(req)

    def runnable(self) -> bool:
        return bool(self.waiting_queue) or self.chunked_req is not None

    def find_waiting(self, rid: str) -> Req | None:
        return next((r for r in self.waiting_queue if r.rid == rid), None)

    def remove(self, req: Req) -> None:
        """A waiting request leaves the queue (it ended: lifecycle.retire)."""
        for i, r in enumerate(self.waiting_queue):
            if r is req:
                del self.waiting_queue[i]
                return

    def expired(self, timeout: float | None, now: float) -> list[Req]:
        """Waiting requests older than `timeout` (the caller retires them)."""
        if timeout is None:
            return []
        return [r for r in self.waiting_queue if now - r.arrival_time > timeout]

    def schedule_next_batch(
        self, running: list[Req], new_token_ratio: float, mixed_decode_tokens: int = 0
    ) -> tuple[ScheduleBatch | None, PrefillAdder | None]:
        """A prefill batch for this round, or None. The chunked request resumes first."""
        if not self.runnable():
            return None, None
        cfg = self.config
        if len(running) >= cfg.max_running_requests and self.chunked_req is None:
            return None, None
        adder = PrefillAdder(
            self.cache, running, new_token_ratio, cfg.max_prefill_tokens, cfg.chunk_size,
            cfg.clip_max_new_tokens, mixed_decode_tokens,
        )
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input(self.cache.tree)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        deprioritized = self.policy.calc_priority(self.waiting_queue)
        slots_left = cfg.max_running_requests - len(running) - len(adder.can_run_list)
        for req in list(self.waiting_queue):
            if slots_left <= 0 or adder.budget_state() != AddReqResult.CONTINUE:
                break
            if req.rid in deprioritized:
                continue
            req.init_next_round_input(self.cache.tree)
            result = adder.add_one_req(req)
            if req in adder.can_run_list:
                self.waiting_queue.remove(req)
                slots_left -= 1
            if result != AddReqResult.CONTINUE:
                break
        if adder.new_chunked_req is not None:
            assert self.chunked_req is None  # invariant: a batch carries one chunked request (prefill_adder)
            self.chunked_req = adder.new_chunked_req
        if self.chunked_req is not None and self.chunked_req in adder.can_run_list:
            self.chunked_req.is_chunked += 1
        if not adder.can_run_list:
            return None, adder
        batch = ScheduleBatch(list(adder.can_run_list))
        batch.prepare_for_extend(self.cache)
        return batch, adder
