"""The decoder layer's small ops, one seam over their implementations.

Between the matmuls a Llama layer runs RMSNorm (with the residual add), qk-norm and RoPE on
q/k, and SiLU*mul. Written as torch ops they are a dozen kernels per layer, each a pass over
the activations: on an H200 at decode batch 1 they took a third of the step. Each
implementation below does them in as few passes as its device allows:

    torch         the HF chain, op for op (the reference; any device, any dtype)
    cpu-kernels   csrc/layer_ops_cpu.cpp (engine/kernels/cpu_kernels.py): rounds where torch does
    flashinfer    FlashInfer's fused CUDA kernels (flashinfer_ops.py): fp32 math, one rounding

The contract (tests/engine/test_layer_ops_contract.py runs it over every implementation):
- `rms_norm(x, w, eps)`: w * x / rms(x) over the last dim of 2-D x, into a new tensor.
- `add_rms_norm(x, residual, w, eps)` -> (rms_norm(residual + x), residual + x). It may
  write both in place, so callers pass tensors this forward owns and use what it returns.
- `silu_and_mul(gate_up)`: silu(gate) * up for gate_up = [gate | up] on the last dim.
- `rope_batch(rotary, positions)`: once per forward, what `qk_rope` reads in every layer.
- `qk_rope(qkv, rope, heads, q_norm, k_norm, eps)` -> q (n, Hq, D), k and v (n, Hkv, D) of the
  qkv rows (n, (Hq + 2 Hkv) D): optional per-head RMSNorm (Qwen3), then neox RoPE. v is a view
  of qkv; q and k may be, and qkv's q/k columns may be overwritten.
- `qk_rope_store(qkv, rope, heads, q_norm, k_norm, eps, slots)`: qk_rope, then k and v written to
  the layer's pool slots, equal bit for bit to that chain (`rope_then_store`). An implementation
  with `fuses_kv_store` does both in one kernel, and the model then hands the attention backend
  k/v already stored (attention/base.py); the others only ever run the chain, which is the store
  the backend itself makes, so their forwards are unchanged.
All take and return the activation dtype; where they round differs (each file says how).
Which one a runner uses is layer_ops_choice.py's decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

from tandem.engine.kernels import cpu_kernels
from tandem.engine.kvcache.kv_slots import KVSlots

if TYPE_CHECKING:
    from tandem.engine.models.rotary import RotaryEmbedding


@dataclass(frozen=True)
class Heads:
    """This rank's attention heads: the q, k and v column blocks of a qkv row."""

    q: int
    kv: int
    dim: int

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = qkv.split([self.q * self.dim, self.kv * self.dim, self.kv * self.dim], dim=-1)
        n = qkv.shape[0]
        return q.view(n, self.q, self.dim), k.view(n, self.kv, self.dim), v.view(n, self.kv, self.dim)


@dataclass
class RopeBatch:
    """One forward's RoPE inputs, shared by all layers: the positions and whatever table
    form the implementation reads (torch: per-token cos/sin; kernels: the whole table)."""

    positions: torch.Tensor  # (tokens,) int64
    cos: torch.Tensor
    sin: torch.Tensor | None = None


class LayerOps(Protocol):
    name: str

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]: ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...

    def rope_batch(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> RopeBatch: ...

    def qk_rope(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...

    fuses_kv_store: bool

    def qk_rope_store(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float,
                      slots: KVSlots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]: ...


def rope_then_store(ops: LayerOps, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                    k_norm: torch.Tensor | None, eps: float,
                    slots: KVSlots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The unfused chain every `qk_rope_store` equals: `ops.qk_rope`, then the store."""
    q, k, v = ops.qk_rope(qkv, rope, heads, q_norm, k_norm, eps)
    slots.k_buffer.index_copy_(0, slots.loc, k.to(slots.k_buffer.dtype))
    slots.v_buffer.index_copy_(0, slots.loc, v.to(slots.v_buffer.dtype))
    return q, k, v


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: the statistics in fp32, the normalised x rounded to x's dtype, then
    the weight multiply in that dtype (two roundings, which the fused kernels do not copy)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class TorchLayerOps:
    """The reference: HF's own ops, so fp32 logits match it to ~1e-5 on any device."""

    name = "torch"
    fuses_kv_store = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return torch_rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return torch_rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_batch(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> RopeBatch:
        # cos/sin looked up per token and cast to the activation dtype, as HF does
        cos, sin = rotary.cos[positions].to(dtype), rotary.sin[positions].to(dtype)
        return RopeBatch(positions, cos[:, None, :], sin[:, None, :])

    def qk_rope(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = heads.split(qkv)
        if q_norm is not None and k_norm is not None:
            q, k = torch_rms_norm(q, q_norm, eps), torch_rms_norm(k, k_norm, eps)
        cos, sin = rope.cos, rope.sin
        assert sin is not None  # invariant: RopeBatch always carries sin for this op
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def qk_rope_store(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float,
                      slots: KVSlots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rope_then_store(self, qkv, rope, heads, q_norm, k_norm, eps, slots)


class CpuKernelOps:
    """The fused CPU ops (csrc/layer_ops_cpu.cpp): bit-identical to TorchLayerOps in bf16."""

    name = "cpu-kernels"
    fuses_kv_store = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return cpu_kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        cpu_kernels.fused_add_rms_norm(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(gate_up)

    def rope_batch(self, rotary: RotaryEmbedding, positions: torch.Tensor, dtype: torch.dtype) -> RopeBatch:
        return RopeBatch(positions, rotary.cos, rotary.sin)  # the kernel reads the tables itself

    def qk_rope(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                k_norm: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        assert rope.sin is not None  # invariant: RopeBatch always carries sin for this op
        cpu_kernels.rope_qk(qkv, rope.positions, rope.cos, rope.sin, q_norm, k_norm, heads.q, heads.kv,
                            heads.dim, eps)
        return heads.split(qkv)

    def qk_rope_store(self, qkv: torch.Tensor, rope: RopeBatch, heads: Heads, q_norm: torch.Tensor | None,
                      k_norm: torch.Tensor | None, eps: float,
                      slots: KVSlots) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return rope_then_store(self, qkv, rope, heads, q_norm, k_norm, eps, slots)


TORCH = TorchLayerOps()

