"""Priority scheduling's preemption: a waiting request that outranks running ones by
`priority_scheduling_preemption_threshold` retracts them (lowest priority, newest first)
until it has a running slot and KV room. Retracted requests return to the waiting queue;
their KV goes to the prefix cache, so their re-admission usually hits it."""

from __future__ import annotations

from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.decode_manager import DecodeManager
from tandem.engine.scheduler.prefill_manager import PrefillManager


def preempt_for_priority(cfg: EngineConfig, prefill: PrefillManager, decode: DecodeManager,
                         cache: CacheManager) -> None:
    if not cfg.enable_priority_scheduling or not prefill.waiting_queue or not decode.runnable():
        return
    top = max(prefill.waiting_queue, key=lambda r: r.priority)
    need = len(top.origin_input_ids) + min(top.sampling_params.max_new_tokens, cfg.clip_max_new_tokens)
    full = len(decode.reqs) >= cfg.max_running_requests
    if not full and cache.available_tokens() >= need:
        return
    victims = sorted(
        (r for r in decode.reqs
         if top.priority - r.priority >= cfg.priority_scheduling_preemption_threshold and not r.finished()),
        key=lambda r: (r.priority, -r.arrival_time),
    )
    for v in victims:
        decode.release_for_retract(v)  # its KV goes to the prefix cache: evictable now
        prefill.add(v)
        left = sum(1 for r in decode.reqs if not (r.is_retracted or r.finished()))
        if left < cfg.max_running_requests and cache.available_tokens() >= need:
            break
    decode.running_batch.filter_batch()
