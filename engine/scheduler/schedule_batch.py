"""ScheduleBatch: the scheduler's batch, and how it flattens into a ModelWorkerBatch (worker_batch.py).

    ScheduleBatch  --get_model_worker_batch()-->  ModelWorkerBatch  --worker-->  ForwardBatch

`output_ids` holds, per request, the token the next decode step feeds in: a
real id once results are processed, or a negative FutureMap index while the
step that samples it is still in flight (overlap mode).

Per-token arrays (input ids, output ids, KV slots) are int64 numpy on the host: a decode
step builds them every iteration, and numpy costs the host a fraction of a torch op each;
the forward thread turns them into device tensors (runner/model_worker.py).

The methods that build a batch's inputs from its requests are @traced: a failure in one
names the batch's requests, which then fail alone (batch_failure.py, batch_faults.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem.engine.forward_batch import ForwardMode
from tandem.engine.scheduler.batch_failure import traced
from tandem.engine.scheduler.cache_manager import CacheManager
from tandem.engine.scheduler.req import Req, ReqStatus
from tandem.engine.worker_batch import ModelWorkerBatch


@dataclass(eq=False)
class ScheduleBatch:
    reqs: list[Req]
    mode: ForwardMode = ForwardMode.DECODE
    output_ids: np.ndarray | None = None  # (batch,) int64: next decode input per request
    input_ids: np.ndarray | None = None
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    out_cache_loc: np.ndarray | None = None
    num_extend_reqs: int = 0
    decoding_reqs: list[Req] = field(default_factory=list)  # MIXED: running reqs riding along

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    # ---- extend ----------------------------------------------------------------------------
    @traced
    def prepare_for_extend(self, cache: CacheManager) -> None:
        self.mode = ForwardMode.EXTEND
        self.prefix_lens = [r.prefix_len for r in self.reqs]
        self.extend_lens = [r.extend_input_len for r in self.reqs]
        self.out_cache_loc = cache.alloc_extend(self.reqs).numpy()
        ids = [t for r, p in zip(self.reqs, self.prefix_lens) for t in r.fill_ids[p:]]
        self.input_ids = np.array(ids, dtype=np.int64)
        self.num_extend_reqs = len(self.reqs)
        for r in self.reqs:
            r.status = ReqStatus.CHUNKED if r.is_chunked else ReqStatus.EXTENDING
            r.is_retracted = False
            r.check_invariants()

    @traced
    def mix_with_running(self, running: ScheduleBatch, cache: CacheManager) -> None:
        """Append the running decode batch to this extend batch: one MIXED forward."""
        running.prepare_for_decode(cache)
        self.mode = ForwardMode.MIXED
        self.decoding_reqs = list(running.reqs)
        self.reqs = self.reqs + running.reqs
        self.prefix_lens += running.prefix_lens
        self.extend_lens += running.extend_lens
        self.input_ids = np.concatenate([self.input_ids, running.input_ids])
        self.out_cache_loc = np.concatenate([self.out_cache_loc, running.out_cache_loc])

    # ---- decode ----------------------------------------------------------------------------
    @traced
    def prepare_for_decode(self, cache: CacheManager) -> None:
        self.mode = ForwardMode.DECODE
        # invariant: set by the step that ran this batch
        assert self.output_ids is not None and len(self.output_ids) == len(self.reqs)
        self.prefix_lens = [r.kv_committed_len for r in self.reqs]
        self.extend_lens = [1] * len(self.reqs)
        self.out_cache_loc = cache.alloc_decode(self.reqs)
        self.input_ids = self.output_ids
        self.num_extend_reqs = 0
        for r in self.reqs:
            r.status = ReqStatus.DECODING
            r.check_invariants()

    # ---- membership -------------------------------------------------------------------------
    def filter_batch(self, keep: list[int] | None = None, exclude: Req | None = None) -> None:
        """Keep unfinished, unretracted requests (or exactly `keep`), minus `exclude`."""
        if keep is None:
            keep = [
                i for i, r in enumerate(self.reqs)
                if not r.finished() and not r.is_retracted and r is not exclude
            ]
        if len(keep) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep]
        if self.output_ids is not None:
            self.output_ids = self.output_ids[keep]

    def merge_batch(self, other: ScheduleBatch) -> None:
        if other.is_empty():
            return
        if self.is_empty():
            self.reqs, self.output_ids = list(other.reqs), other.output_ids
            return
        self.reqs = self.reqs + other.reqs
        assert self.output_ids is not None and other.output_ids is not None  # invariant: both batches have run a step
        self.output_ids = np.concatenate([self.output_ids, other.output_ids])

    def snapshot(self) -> ScheduleBatch:
        """The batch as launched, for processing its results later (membership changes after)."""
        return ScheduleBatch(
            list(self.reqs), self.mode, num_extend_reqs=self.num_extend_reqs,
            prefix_lens=self.prefix_lens, extend_lens=self.extend_lens,
        )

    # ---- hand-off ---------------------------------------------------------------------------
    @traced
    def get_model_worker_batch(self) -> ModelWorkerBatch:
        seq_after = [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]
        return ModelWorkerBatch(
            mode=self.mode,
            input_ids=self.input_ids,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            prefix_lens=list(self.prefix_lens),
            extend_lens=list(self.extend_lens),
            out_cache_loc=self.out_cache_loc,
            num_extend_reqs=self.num_extend_reqs if self.mode != ForwardMode.DECODE else 0,
            sampling_params=[r.sampling_params for r in self.reqs],
            # The token sampled after position s-1 is output number s - input_len.
            sample_positions=[s - len(r.origin_input_ids) for r, s in zip(self.reqs, seq_after)],
            return_logprob=any(
                r.sampling_params.return_logprob or r.sampling_params.top_logprobs_num for r in self.reqs
            ),
        )
