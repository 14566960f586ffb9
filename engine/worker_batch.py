"""ModelWorkerBatch: what the forward thread needs of a scheduled batch, and nothing else.

    ScheduleBatch (scheduler/)  --get_model_worker_batch()-->  ModelWorkerBatch  --runner/-->  ForwardBatch

It sits below both the scheduler and the runner, so neither package imports the other's
types to hand a batch over.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tandem.engine.forward_batch import ForwardMode
from tandem.engine.grammar.batch_mask import BatchMask
from tandem.engine.sampling_params import SamplingParams


@dataclass
class ModelWorkerBatch:
    mode: ForwardMode
    input_ids: np.ndarray  # (tokens,) int64; negative entries are future references
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_cache_loc: np.ndarray  # (tokens,) int64
    num_extend_reqs: int
    sampling_params: list[SamplingParams]
    sample_positions: list[int]  # output index of the token each request samples
    return_logprob: bool
    # The rows' vocabulary mask when any request is constrained (filled by the scheduler,
    # applied by the forward thread before sampling: engine/grammar/batch_mask.py).
    grammar: BatchMask | None = None
    # The KV-tier copies launched with this batch (kvcache/tier_copies.py): its forward waits for
    # each layer of them before touching that layer's KV. None when none are in flight.
    kv_ready: Any = None
