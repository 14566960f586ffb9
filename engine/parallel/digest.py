"""The step digest: a debug check that tensor-parallel ranks launch the same batch.

A rank that scheduled differently would feed its shard different tokens or KV slots, and the
all-reduces would silently mix unrelated requests: wrong tokens, no error. With
`debug_tp_digest` on, each launch hashes what decides the step (mode, rows, lengths, slots,
tokens) to one int64 and the ranks compare; a difference stops the group at the first step
it appears. One 8-byte all-gather per step: cheap, but off by default in production.
"""

from __future__ import annotations

import zlib

import numpy as np

from tandem.engine.parallel.group import TPGroup
from tandem.engine.worker_batch import ModelWorkerBatch


class RanksDiverged(RuntimeError):
    """Tensor-parallel ranks scheduled different batches: the group must stop."""


def batch_digest(mwb: ModelWorkerBatch) -> int:
    h = zlib.crc32(str(mwb.mode).encode())
    for t in (mwb.input_ids, mwb.out_cache_loc):
        h = zlib.crc32(np.ascontiguousarray(t, dtype=np.int64).tobytes(), h)
    for xs in (mwb.req_pool_indices, mwb.prefix_lens, mwb.extend_lens):
        h = zlib.crc32(repr(list(xs)).encode(), h)
    return h


def check_same_batch(tp: TPGroup, mwb: ModelWorkerBatch, step: int) -> None:
    digests = [d[0] for d in tp.all_gather_ints([batch_digest(mwb)])]
    if len(set(digests)) > 1:
        raise RanksDiverged(f"tensor-parallel ranks launched different batches at step {step}: digests {digests}")
