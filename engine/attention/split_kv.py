"""Whether FlashInfer's tensor-core decode splits each request's KV: a setting
(RunnerConfig.decode_split_kv), decided per plan from the batch size.

The tensor-core decode is FlashInfer's prefill kernel with one query row per request; its plan
(PrefillSplitQOKVIndptr in include/flashinfer/attention/scheduler.cuh, FlashInfer 0.7) gives it
2 CTAs per SM and, while the batch's tiles leave CTAs idle, cuts each request's KV into chunks
run by separate CTAs, then a merge kernel combines their partial outputs. Once

    batch >= (2 * SMs) // kv_heads

its chunk search ends at one chunk per request: the grid is already full. Eager, it then runs
unsplit; under CUDA graphs it sets split_kv whatever the search found (`enable_cuda_graph ||
low < max_kv_len`), so every captured decode step writes partial outputs to the workspace and
merges one chunk per request. `disable_split_kv=True` drops both, with the same grid. At small
batches the split is what fills the GPU (batch 1, 8 KV heads: 8 CTAs of 264), so it stays.

The CUDA-core decode kernel decides this itself (no split once batch x KV heads fills its grid,
graphs or not) and its plan ignores the argument. The decision depends only on the batch size,
so a CUDA-graph bucket's wrapper is planned the same way at every replay, as it must be: the
captured launches keep the split or unsplit form they were captured with.
"""

from __future__ import annotations

import torch

CTAS_PER_SM = 2  # PrefillPlanImpl's num_blocks_per_sm


def sm_count(device: torch.device) -> int | None:
    """The device's SMs; None off CUDA (no grid to fill: `auto` leaves FlashInfer's choice)."""
    if device.type != "cuda":
        return None
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_kv_off(batch_size: int, num_kv_heads: int, sms: int | None, setting: bool | None) -> bool:
    """`disable_split_kv` for a decode plan of `batch_size` requests. `setting` False: always
    off; True: FlashInfer's own choice; None: off where FlashInfer's search would not split."""
    if setting is not None:
        return not setting
    return sms is not None and batch_size >= CTAS_PER_SM * sms // num_kv_heads
