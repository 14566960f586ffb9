"""Scheduler: wires the managers; the event loops drive it.

    normal loop:   recv -> schedule N -> run N -> process N
    overlap loop:  recv -> schedule N -> launch N -> process N-1 -> (N in flight)

The two loops stand side by side in event_loops.py (`run`); this module is what they drive:
receiving, batch construction, running and processing a batch, idleness. A request's life,
and its one ending, is lifecycle.py's; a role part and the fault handling get that, never
this class.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import deque
from collections.abc import Callable
from functools import partial
from typing import Any

from tandem.engine import heap
from tandem.engine.engine_config import EngineConfig
from tandem.engine.forward_batch import ForwardMode
from tandem.engine.kvcache.disk_tier import disk_tier
from tandem.engine.kvcache.event_publisher import ZmqEventPublisher
from tandem.engine.kvcache.host_tier import HostTier, host_tokens
from tandem.engine.kvcache.kv_events import KVEventLog, KVEventsConfig
from tandem.engine.kvcache.kv_memory import KVMemory
from tandem.engine.kvcache.radix_cache import create_prefix_cache
from tandem.engine.parallel.digest import check_same_batch
from tandem.engine.parallel.tick import exchange
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.model_worker import GenerationBatchResult, ModelWorker, OverlapWorker
from tandem.engine.scheduler import admin
from tandem.engine.scheduler.batch_faults import BatchFaults
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.decode_manager import DecodeManager
from tandem.engine.scheduler.grammar_manager import GrammarManager
from tandem.engine.scheduler.lifecycle import Lifecycle
from tandem.engine.scheduler.metrics import SchedulerMetrics
from tandem.engine.scheduler.output_processor import OutputProcessor
from tandem.engine.scheduler.prefill_manager import PrefillManager
from tandem.engine.scheduler.priority import preempt_for_priority
from tandem.engine.scheduler.req import FinishReason, KVFate, Req, ReqStatus, finish_abort
from tandem.engine.scheduler.request_validation import build_req
from tandem.engine.scheduler.role_part import Admission, RolePart
from tandem.engine.scheduler.schedule_batch import ScheduleBatch
from tandem.engine.scheduler.schedule_policy import SchedulePolicy
from tandem.engine.worker_batch import ModelWorkerBatch
from tandem.protocol.messages import (
    AbortReq,
    FlushCacheReq,
    GenerateReq,
    ReqOutput,
    ShutdownReq,
    StatusReq,
    dispatch,
    is_admin,
)

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        memory: KVMemory,
        inbox: queue.Queue | queue.SimpleQueue,
        emit: Callable[[list[ReqOutput]], None],
        tokenizer: Callable[[], Any],
        dp_rank: int = 0,
    ) -> None:
        self.config = config
        self.runner = runner
        self.inbox = inbox
        self.dp_rank = dp_rank
        # Tensor parallelism: every rank runs this scheduler; rank 0's inputs and clock reach
        # the others each iteration (parallel/tick.py), so all of them decide alike.
        self.tp = runner.tp
        self.steps = 0
        host = None
        if config.enable_hierarchical_cache:
            tokens = host_tokens(memory.kv_pool, config.hicache_ratio, config.hicache_size)
            host = HostTier(memory.kv_pool, tokens, config.hicache_write_policy)
        self.host = host
        # KV events (kvcache/kv_events.py): the TP ranks hold the same cache, so one publishes.
        events = KVEventsConfig.parse(config.kv_events_config)
        self.kv_event_log: KVEventLog | None = None
        self.kv_events: ZmqEventPublisher | None = None
        if events.enabled and self.tp.leader:
            self.kv_event_log = KVEventLog(memory.kv_pool.page_size)
            self.kv_events = ZmqEventPublisher(events, dp_rank)
        self.disk = disk_tier(config, runner, memory.kv_pool, host) if config.hicache_storage_backend else None
        tree = create_prefix_cache(
            config.disable_radix_cache, memory.req_table, memory.kv_pool.allocator, memory.kv_pool.page_size, host,
            self.kv_event_log, self.disk, self.tp.min_int if self.tp.size > 1 else None,
        )
        # Overlap: a batch's results are processed while the next batch runs (cache_manager.py)
        self.cache = CacheManager(memory.req_table, memory.kv_pool, tree, hold_freed=config.enable_overlap)
        self.policy = SchedulePolicy(config.schedule_policy, tree, config.enable_priority_scheduling, config.seed)
        self.prefill = PrefillManager(config, self.cache, self.policy)
        self.decode = DecodeManager(config, self.cache)
        self.output = OutputProcessor(self.cache, runner.model_config.eos_token_ids, tokenizer, emit)
        self.metrics = SchedulerMetrics()
        self.life = Lifecycle(config, self.tp, dp_rank, inbox, memory.kv_pool, runner.vocab_size, self.cache,
                              self.prefill, self.decode, self.output, self.metrics)
        self.output.retire = self.life.retire
        self.worker = ModelWorker(runner)
        self.overlap: OverlapWorker | None = None
        if config.enable_overlap:
            self.overlap = OverlapWorker(self.worker, runner.future_map)
        self.grammar = GrammarManager(config, tokenizer, runner.vocab_size, runner.model_config.eos_token_ids,
                                      admit=self.admit, fail=self.life.retire, end=self.life.end)
        self.faults = BatchFaults(self.life)
        self.last_batch: ScheduleBatch | None = None
        self.in_flight: deque[tuple[ScheduleBatch, Any]] = deque()  # launched, not processed (overlap)
        self.running = True
        self.idle_checked = False
        self.part: RolePart | None = None  # the prefill or decode role's transfer part (attach)
        self.request_handlers: dict[type, Callable[[Any], Any]] = {
            GenerateReq: self.add_request, AbortReq: lambda m: self.abort(m.rid)}
        self.admin_handlers = {FlushCacheReq: partial(admin.flush_cache, self), StatusReq: partial(admin.status, self),
                               ShutdownReq: self.shutdown}

    @property
    def now(self) -> float:
        return self.life.now

    @property
    def reqs(self) -> dict[str, Req]:
        return self.life.reqs

    def attach(self, part: RolePart) -> None:
        """Compose in a role's transfer part (prefill/sender.py, decode/receiver.py): it takes
        the requests it admits, handles its own inbox messages, and is polled every loop."""
        self.part = self.life.part = part
        self.request_handlers.update(part.handlers)
        if part.contiguous_pages:
            self.cache.allocator.keep_free_list_sorted()

    # ---- input ---------------------------------------------------------------------------------
    def publish_kv_events(self) -> None:
        """The last step's KV events as one batch (before the loop may block waiting)."""
        if self.kv_event_log is not None and self.kv_events is not None:
            batch = self.kv_event_log.drain(self.dp_rank)
            if batch is not None:
                self.kv_events.publish(batch)

    def recv_requests(self, block: bool) -> list[Any]:
        self.output.flush()  # what ended since the last results (aborts, timeouts) goes out before waiting
        self.publish_kv_events()
        msgs = self._drain_inbox(block) if self.tp.leader else None
        if self.tp.size == 1:
            self.life.now = time.monotonic()
            return msgs or []
        codec = self.part.tick_codec if self.part is not None else None
        tick = exchange(self.tp, msgs, self.grammar.decide() if self.tp.leader else None, codec)
        self.life.now, self.grammar.verdicts, self.grammar.budget_verdicts = tick.now, tick.grammar, tick.over_budget
        return tick.msgs

    def _drain_inbox(self, block: bool) -> list[Any]:
        msgs: list[Any] = []
        # Waiting only on a KV transfer or a compile: wake often to poll, without spinning a core.
        timeout = 0.05 if block else 0.002 if self.only_waiting() else 0
        try:
            msgs.append(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                msgs.append(self.inbox.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def process_input_requests(self, msgs: list[Any]) -> None:
        for msg in msgs:
            if is_admin(msg):
                result = dispatch(msg, self.admin_handlers)
                if result is not None:
                    self.output.emit([result])
            else:
                dispatch(msg, self.request_handlers)
        self.grammar.poll()  # after the messages: an abort among them wins over a verdict
        if self.part is not None:
            self.part.poll()
        self.output.flush()  # aborts' last outputs, a transferred request's first token: now, not a step later

    def add_request(self, msg: GenerateReq) -> None:
        req, error = build_req(msg, self.runner, self.config, in_use=msg.rid in self.reqs)
        if error is not None:
            self.output.emit([error])
            return
        self.life.add(req)
        self.grammar.add(req, msg)  # admits it now, or once its grammar is compiled

    def admit(self, req: Req, msg: GenerateReq) -> None:
        verdict = Admission.LOCAL if self.part is None else self.part.admit(req, msg)
        if verdict is Admission.LOCAL:
            self.life.queue_prefill(req)
        elif isinstance(verdict, FinishReason):
            self.life.retire(req, verdict)

    def shutdown(self, msg: ShutdownReq) -> None:
        self.running = False

    def abort(self, rid: str) -> None:
        if self.part is not None and self.part.abort(rid):
            return
        req = self.grammar.abort(rid)
        if req is not None:
            self.life.retire(req, finish_abort("aborted while its grammar compiled"))
            return
        req = self.reqs.get(rid)
        if req is not None:
            waiting = req.status in (ReqStatus.WAITING, ReqStatus.RETRACTED)
            self.life.end(req, finish_abort("aborted while waiting" if waiting else "aborted by client"))

    # ---- batch construction ----------------------------------------------------------------------
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        cfg = self.config
        for r in self.prefill.expired(cfg.waiting_timeout, self.now):
            self.life.retire(r, finish_abort(f"waited longer than waiting_timeout={cfg.waiting_timeout}s"))
        for r in self.decode.expired(cfg.running_timeout, self.now):
            self.life.end(r, finish_abort(f"ran longer than running_timeout={cfg.running_timeout}s"))
        last = self.last_batch
        if last is not None and last.mode.is_extend():
            # Its requests (and, if MIXED, the decodes that rode along) continue decoding.
            self.life.join_running(ScheduleBatch(list(last.reqs), output_ids=last.output_ids),
                                   exclude=self.prefill.chunked_req)
        preempt_for_priority(self.config, self.prefill, self.decode, self.cache)
        mixed = self.config.enable_mixed_chunk and self.decode.runnable()
        running = [r for r in self.decode.reqs if not r.finished()]
        batch, adder = self.prefill.schedule_next_batch(
            running, self.decode.new_token_ratio, len(running) if mixed else 0)
        if adder is not None:
            self.metrics.on_prefill_round(adder)
        if batch is not None:
            if mixed:
                self.decode.running_batch.filter_batch()
                if not self.decode.running_batch.is_empty():
                    batch.mix_with_running(self.decode.running_batch, self.cache)
                    self.decode.running_batch = ScheduleBatch([])
            return batch
        decode_batch, retracted = self.decode.update_running_batch()
        for r in reversed(retracted):
            self.prefill.add(r, front=True)
        return decode_batch

    # ---- running ----------------------------------------------------------------------------------
    def record_step(self, batch: ScheduleBatch, mwb: ModelWorkerBatch) -> None:
        """Bookkeeping of a batch about to launch; with debug_tp_digest, the ranks first
        check that they all launch this same batch (parallel/digest.py)."""
        self.steps += 1
        mwb.kv_ready = self.cache.tree.launch_copies()  # the tiers' copies run beside its forward
        if self.config.debug_tp_digest and self.tp.size > 1:
            check_same_batch(self.tp, mwb, self.steps)
        self.idle_checked = False
        self.metrics.on_launch(batch)
        self.metrics.on_step(len(self.prefill.waiting_queue), len(self.decode.reqs), self.cache.usage())

    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        mwb = batch.get_model_worker_batch()
        self.record_step(batch, mwb)
        mask = self.grammar.attach_mask(batch.reqs, mwb)
        if mask is not None:
            mask.fill()  # every earlier batch is processed: the matchers are current
        return self.worker.forward_batch_generation(mwb)

    def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None:
        result.materialize()
        self.cache.reclaim()  # every batch launched before the held frees has completed
        self.metrics.on_result(batch, result)
        with self.cache.holding():
            if batch.mode == ForwardMode.DECODE:
                self.output.process_decode(batch, result)
            else:
                self.output.process_prefill(batch, result)
            if self.part is not None:
                self.part.on_batch_done(batch)
        self.output.flush()
        heap.trim(min_interval=heap.TRIM_PERIOD)  # under load too: the idle hook may not come

    def self_check_during_idle(self) -> None:
        """On entering idle: reset congestion control, check the pools and give the heap's
        free pages back (heap.py), once."""
        if not self.idle() or self.idle_checked:
            return
        self.idle_checked = True
        self.output.flush()
        self.metrics.mark_idle()
        self.decode.new_token_ratio = self.decode.init_new_token_ratio
        self.cache.check_integrity()
        self.life.check_integrity()
        if self.part is not None:
            self.part.check_integrity()
        heap.trim()

    def cache_changed(self) -> None:
        self.idle_checked = False  # check the pools again at the next idle

    def load(self) -> dict[str, Any]:
        return {
            "num_waiting": len(self.prefill.waiting_queue),
            "num_running": sum(not r.finished() for r in self.decode.reqs),
            "metrics": self.metrics.snapshot(), "requests": self.life.status(),  # registered, held
            "pd": self.part.status() if self.part is not None else None, "grammar": self.grammar.status(),
        }

    # ---- loops ----------------------------------------------------------------------------------------
    def idle(self) -> bool:
        """No work left and no batch in flight (what the cache holds for one is reclaimable)."""
        return not self.in_flight and self.all_finished()

    def all_finished(self) -> bool:
        """Every request received has settled: the lifecycle's registry sees them all (waiting,
        chunked, running, those of a prefill batch just processed but not yet merged into the
        running set, those a role part holds), and a flush landing on one found its prefix
        locks once. A part's own work in flight (a transfer's KV) counts too."""
        return self.life.settled() and (self.part is None or not self.part.busy())

    def only_waiting(self) -> bool:
        """Nothing to compute now, but requests wait on something else: their grammar's
        compile, or (in a role part) their KV in flight."""
        # The cheap tests first: this runs every loop iteration that does not block.
        return (self.grammar.waiting or (self.part is not None and self.part.busy())) and not (
            self.prefill.runnable() or self.decode.runnable())

    def end_all(self) -> None:
        """Shutdown: every request still here ends with a 503 a router may retry elsewhere."""
        gone = finish_abort("the engine shut down before this request finished", 503)
        with self.cache.holding():
            self.life.retire_all([r for r in self.reqs.values() if not r.finished()], gone, KVFate.CACHE)
        for r in list(self.reqs.values()):
            self.life.release_held(r, KVFate.DISCARD)  # a role part's transfers are abandoned with it
        self.output.flush()
        self.cache.reclaim()

    def close(self) -> None:
        self.grammar.shutdown()
        if self.host is not None:
            self.host.close()  # its queued copies first: they may still put pages to the disk tier
        if self.disk is not None:
            self.disk.close()
        if self.kv_events is not None:
            self.publish_kv_events()
            self.kv_events.close()
        if self.overlap is not None:
            self.overlap.shutdown()
