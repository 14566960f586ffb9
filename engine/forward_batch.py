"""ForwardBatch: the flattened, device-side description of one model forward.

The last step of ScheduleBatch -> ModelWorkerBatch -> ForwardBatch. Requests are
flattened into one token axis; request i owns tokens
[extend_start[i], extend_start[i] + extend_lens[i]) of `input_ids`.

    req i:      prefix (already in KV)          new tokens (this forward)
    positions:  0 ... prefix_lens[i]-1   |   prefix_lens[i] ... seq_lens[i]-1

In MIXED mode the first `num_extend_reqs` requests are extends (prefill
chunks) and the rest are decodes (extend_len 1), so backends can split the
batch at one index.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill, possibly on top of a cached prefix
    DECODE = 2  # one new token per request
    MIXED = 3  # extend requests followed by decode requests in one forward
    IDLE = 4  # nothing to run (kept for DP ranks with no work)

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED)


@dataclass
class ForwardBatch:
    mode: ForwardMode
    input_ids: torch.Tensor  # (num_tokens,) int64
    positions: torch.Tensor  # (num_tokens,) int64
    out_cache_loc: torch.Tensor  # (num_tokens,) int64: KV slot each new token writes
    req_pool_indices: torch.Tensor  # (batch,) int64: row in req_to_token
    req_pool_indices_cpu: list[int]
    seq_lens: torch.Tensor  # (batch,) int32: prefix + new tokens
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    num_extend_reqs: int
    logits_indices: torch.Tensor  # (batch,) int64: last new token of each request
    attn_metadata: Any = field(default=None, repr=False)
    kv_ready: Any = field(default=None, repr=False)  # KV-tier copies to wait for, by layer (tier_copies.py)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())

    @classmethod
    def build(
        cls,
        mode: ForwardMode,
        input_ids: torch.Tensor | list[int],
        req_pool_indices: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        out_cache_loc: torch.Tensor,
        device: torch.device | str,
        num_extend_reqs: int | None = None,
    ) -> ForwardBatch:
        """Build the device tensors from per-request CPU lists (one host->device copy each)."""
        if len(req_pool_indices) != len(prefix_lens) or len(prefix_lens) != len(extend_lens):
            raise ValueError("per-request lists differ in length")
        if mode == ForwardMode.DECODE and any(e != 1 for e in extend_lens):
            raise ValueError("decode batches carry exactly one new token per request")
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        prefix_t = torch.tensor(prefix_lens, dtype=torch.int64)
        extend_t = torch.tensor(extend_lens, dtype=torch.int64)
        ends = extend_t.cumsum(0)
        if mode == ForwardMode.DECODE:
            positions = prefix_t
        else:
            # token t of the flat batch belongs to request i; its position is
            # prefix_i + (t - start_i), i.e. t + (prefix_i - start_i) repeated per token.
            offsets = torch.repeat_interleave(prefix_t - (ends - extend_t), extend_t)
            positions = torch.arange(int(ends[-1]) if len(ends) else 0, dtype=torch.int64) + offsets
        if not isinstance(input_ids, torch.Tensor):
            input_ids = torch.tensor(input_ids, dtype=torch.int64)
        if input_ids.numel() != positions.numel() or out_cache_loc.numel() != positions.numel():
            raise ValueError("input_ids / out_cache_loc do not match the extend lengths")
        if num_extend_reqs is None:
            num_extend_reqs = 0 if mode == ForwardMode.DECODE else len(seq_lens)
        return cls(
            mode=mode,
            input_ids=input_ids.to(device, non_blocking=True),
            positions=positions.to(device, non_blocking=True),
            out_cache_loc=out_cache_loc.to(device, torch.int64, non_blocking=True),
            req_pool_indices=torch.tensor(req_pool_indices, dtype=torch.int64).to(device, non_blocking=True),
            req_pool_indices_cpu=list(req_pool_indices),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32).to(device, non_blocking=True),
            seq_lens_cpu=seq_lens,
            prefix_lens_cpu=list(prefix_lens),
            extend_lens_cpu=list(extend_lens),
            num_extend_reqs=num_extend_reqs,
            logits_indices=(ends - 1).to(device, non_blocking=True),
        )
