"""The decoder layer's small ops on CUDA, through FlashInfer's fused kernels (layer_ops.py).

Per layer this is four kernels where the torch chain runs about twenty (on an H200 at decode
batch 1: mean reductions, casts, cat, elementwise and the residual adds, 0.6-0.7 ms of a 2 ms
step):

    fused_add_rmsnorm   residual += x; x = w * residual / rms(residual)   in place, one pass
    apply_rope_with_cos_sin_cache_inplace   neox RoPE on the q and k columns of qkv, in place
    silu_and_mul        one pass over gate_up
    rmsnorm             the first layer's norm and (Qwen3) the per-head q/k norms

With `qk_rope_store` (the attention backend hands over the layer's pool slots: fused_rope_kv),
RoPE and the K/V store are one Triton kernel instead (rope_kv_triton.py), over the same table
and with the same fp32 math; qk-norm still runs first, as FlashInfer's rmsnorm.

Numerics: each kernel computes in fp32 and rounds once, where HF's bf16 chain rounds after
every op, so results are not bit-equal to the torch path but at least as close to an fp32
reference (the GPU tests hold them to HF's own bf16 error). RoPE reads a (positions, dim) fp32
table of [cos | sin] halves, built once from the model's tables: those are cast to the model
dtype at load, as HF casts its cos/sin, so both round the angles alike.

FlashInfer's kernels exist for bf16/fp16 only and its RoPE for head dims 64/128/256 on the
fast path; `layer_ops_choice.choose` keeps every other model on the torch ops.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tandem.engine.kvcache import rope_kv_triton
from tandem.engine.kvcache.kv_slots import KVSlots
from tandem.engine.models.layer_ops import Heads, RopeBatch

if TYPE_CHECKING:
    from tandem.engine.models.rotary import RotaryEmbedding


class FlashInferLayerOps:
    name = "flashinfer"
    fuses_kv_store = True  # where the backend offers slots: it does so only where Triton runs

    def __init__(self, rotary: RotaryEmbedding) -> None:
        """For the model whose RoPE is `rotary`: its table is built here, before any forward
        (none may allocate under a graph capture)."""
        import flashinfer.activation
        import flashinfer.norm
        import flashinfer.rope

        self._norm, self._rope, self._act = flashinfer.norm, flashinfer.rope, flashinfer.activation
        half = rotary.cos.shape[-1] // 2
        # cos and sin repeat their halves (neox: the table is cat(freqs, freqs)), so one half each
        self._table = torch.cat([rotary.cos[:, :half], rotary.sin[:, :half]], dim=-1).float().contiguous()

    def warm_up(self, hidden: int, intermediate: int, heads: Heads, like: torch.Tensor) -> None:
        """Run every op once on two rows of this model's shapes, on its device and dtype: FlashInfer
        builds (JIT) and loads each kernel on first use, which must happen now, not mid-forward."""
        rows = torch.ones(2, hidden, dtype=like.dtype, device=like.device)
        weight = torch.ones(hidden, dtype=like.dtype, device=like.device)
        self.add_rms_norm(self.rms_norm(rows, weight, 1e-6), rows.clone(), weight, 1e-6)
        self.silu_and_mul(torch.ones(2, 2 * intermediate, dtype=like.dtype, device=like.device))
        qkv = torch.ones(2, (heads.q + 2 * heads.kv) * heads.dim, dtype=like.dtype, device=like.device)
        norm = torch.ones(heads.dim, dtype=like.dtype, device=like.device)
        positions = torch.zeros(2, dtype=torch.int64, device=like.device)
        self.qk_rope(qkv, RopeBatch(positions, self._table), heads, norm, norm, 1e-6)  # qk-norm and RoPE
        if like.device.type == "cuda":
            torch.cuda.synchronize(like.device)  # a launch error surfaces here, not in the first step

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm.rmsnorm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        self._norm.fused_add_rmsnorm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._act.silu_and_mul(gate_up)

    def rope_batch(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> RopeBatch:
        return RopeBatch(positions, self._table)  # the table of the model these ops were built for

    def _qk_norm(self, qkv: torch.Tensor, heads: Heads, q_norm: torch.Tensor | None, k_norm: torch.Tensor | None,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = heads.split(qkv)  # strided views: the RoPE kernels take a row stride
        if q_norm is not None and k_norm is not None:
            # Out of place: the kernel's input and output pointers are __restrict__.
            q, k = self._norm.rmsnorm(q, q_norm, eps), self._norm.rmsnorm(k, k_norm, eps)
        return q, k, v

    def qk_rope(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._qk_norm(qkv, heads, q_norm, k_norm, eps)
        self._rope.apply_rope_with_cos_sin_cache_inplace(rope.positions, q, k, heads.dim, rope.cos, is_neox=True)
        return q, k, v

    def qk_rope_store(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float,
                      slots: KVSlots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self._qk_norm(qkv, heads, q_norm, k_norm, eps)
        rope_kv_triton.rope_store(q, k, v, rope.positions, rope.cos, slots.k_buffer, slots.v_buffer, slots.loc)
        return q, k, v
