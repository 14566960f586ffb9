"""DecodeManager: owns the running batch and the new_token_ratio congestion control.

Every decode step needs one more KV slot per running request. Before a step
(check_decode_mem): if free + evictable KV cannot hold it, evict from the
prefix cache first, and only then retract running requests (retract_decode):
fewest generated tokens first, then longest input, until what remains can run
`retract_decode_steps` more steps. Retracted requests return to the front of
the waiting queue and are re-prefilled later (their KV goes to the prefix
cache, so a re-admission usually hits it).

new_token_ratio is the share of each running request's remaining max_new_tokens
the prefill budget reserves. Like TCP congestion avoidance it starts high,
decays a little after each successful decode step (admitting more), and jumps
back up on a retraction (admitting less).
"""

from __future__ import annotations

from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler.batch_failure import BatchFailed
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.req import Req
from tandem.engine.scheduler.schedule_batch import ScheduleBatch


class DecodeManager:
    def __init__(self, config: EngineConfig, cache: CacheManager) -> None:
        self.config = config
        self.cache = cache
        self.running_batch = ScheduleBatch([])
        self.init_new_token_ratio = min(1.0, config.init_new_token_ratio * config.schedule_conservativeness)
        self.min_new_token_ratio = min(
            self.init_new_token_ratio, config.init_new_token_ratio * config.min_new_token_ratio_factor
        ) * config.schedule_conservativeness
        self.new_token_ratio_decay = (
            self.init_new_token_ratio - self.min_new_token_ratio
        ) / config.new_token_ratio_decay_steps
        self.new_token_ratio = self.init_new_token_ratio
        self.num_retracted = 0

    @property
    def reqs(self) -> list[Req]:
        return self.running_batch.reqs

    def runnable(self) -> bool:
        return not self.running_batch.is_empty()

    def expired(self, timeout: float | None, now: float) -> list[Req]:
        """Running requests older than `timeout`, not ending yet (the caller ends them)."""
        if timeout is None:
            return []
        return [r for r in self.reqs if now - r.arrival_time > timeout and not r.finished() and r.to_finish is None]

    # ---- memory check and retraction ---------------------------------------------------------
    def _fits(self, reqs: list[Req], steps: int) -> bool:
        P = self.cache.page_size
        need = sum(-(-(r.kv_committed_len + steps) // P) - (-(-r.kv_committed_len // P)) for r in reqs)
        return need * P <= self.cache.available_tokens()

    def check_decode_mem(self) -> bool:
        return self._fits(self.reqs, 1)

    def retract_order(self, reqs: list[Req]) -> list[Req]:
        """Victims first: fewest outputs, then longest input."""
        return sorted(reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))

    def retract_decode(self) -> list[Req]:
        """Retract until the rest can decode retract_decode_steps steps (or one is left)."""
        keep = list(self.reqs)
        retracted: list[Req] = []
        victims = self.retract_order(keep)
        while len(keep) > 1 and not self._fits(keep, self.config.retract_decode_steps):
            victim = victims.pop(0)
            keep.remove(victim)
            self.release_for_retract(victim)
            retracted.append(victim)
        self.running_batch.filter_batch()
        if not self._fits(keep, 1):
            raise MemoryError("KV pool cannot hold even one request's next token")
        self.num_retracted += len(retracted)
        return retracted

    def release_for_retract(self, req: Req) -> None:
        self.cache.release(req)
        req.reset_for_retract()

    def update_running_batch(self) -> tuple[ScheduleBatch | None, list[Req]]:
        """The decode batch for this step plus any requests retracted to make room."""
        batch = self.running_batch
        batch.filter_batch()
        if batch.is_empty():
            return None, []
        retracted: list[Req] = []
        if not self.check_decode_mem():
            retracted = self.retract_decode()
            # Congestion: reserve at least what the survivors have decoded plus the
            # retract horizon, as a share of the most they may decode.
            decoded = sum(len(r.output_ids) for r in self.reqs)
            budget = sum(min(r.sampling_params.max_new_tokens, self.config.clip_max_new_tokens)
                         for r in self.reqs) or 1
            horizon = self.config.retract_decode_steps * len(self.reqs)
            self.new_token_ratio = min(1.0, max(self.new_token_ratio, (decoded + horizon) / budget))
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.new_token_ratio_decay, self.min_new_token_ratio)
        if batch.is_empty():
            return None, retracted
        try:
            batch.prepare_for_decode(self.cache)
        except BatchFailed as exc:  # the retracted would be lost, in no queue: they fail with the batch
            raise BatchFailed(exc.reqs + retracted, exc.cause) from exc.cause
        return batch, retracted
