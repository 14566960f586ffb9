"""Stand-ins for FlashInfer 0.7's norm, RoPE and activation kernels on CPU (fake_flashinfer.install
adds them as flashinfer.norm, flashinfer.rope and flashinfer.activation).

Each keeps the real function's signature and refuses what the real one refuses, read from its
source (csrc/norm.cu, rope.cu, the act_and_mul template): half dtypes only, the last dim
contiguous, 2-D (or 3-D per-head) norms, an fp32 [cos | sin] table, int32/int64 positions. Where
the real kernel would silently misread, the stand-in is stricter still: a weight of another dtype
than the input (the kernel reinterprets its bytes) and a strided silu_and_mul input (the kernel
indexes rows as if dense) are errors. Each computes in fp32 and rounds once, as the kernels do.
"""

from __future__ import annotations

import types

import torch

HALF = (torch.float16, torch.bfloat16)


def _half(*ts: torch.Tensor) -> None:
    for t in ts:
        if t.dtype not in HALF:
            raise TypeError(f"FlashInfer's kernel is built for float16/bfloat16, got {t.dtype}")


def _last_dim_contiguous(**ts: torch.Tensor) -> None:
    for name, t in ts.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dim")


def _weight(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {x.shape[-1]}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight is {weight.dtype} and input {x.dtype}: the kernel would misread it")
    if weight.device != x.device:
        raise ValueError("weight and input on different devices")


def _normed(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.float()


def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
            enable_pdl: bool | None = None) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(input)
    _half(input)
    _last_dim_contiguous(input=input, output=out, weight=weight)
    if input.dim() not in (2, 3) or out.shape != input.shape:
        raise ValueError(f"Unsupported input dimension: {input.dim()} (or out shape {tuple(out.shape)})")
    _weight(input, weight)
    out.copy_(_normed(input.float(), weight, eps).to(input.dtype))
    return out


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: bool | None = None) -> None:
    _half(input, residual)
    _last_dim_contiguous(input=input, residual=residual, weight=weight)
    if input.dim() != 2 or residual.shape != input.shape or residual.dtype != input.dtype:
        raise ValueError("input and residual must be 2-D of one shape and dtype")
    _weight(input, weight)
    x = input.float() + residual.float()
    residual.copy_(x.to(residual.dtype))  # the kernel stores the rounded sum ...
    input.copy_(_normed(x, weight, eps).to(input.dtype))  # ... and normalises the fp32 one


def apply_rope_with_cos_sin_cache_inplace(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                                          head_size: int, cos_sin_cache: torch.Tensor,
                                          is_neox: bool = True) -> None:
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    q, k = query.view(query.shape[0], -1, head_size), key.view(key.shape[0], -1, head_size)
    _half(q, k)
    _last_dim_contiguous(q=q, k=k)
    if not cos_sin_cache.is_contiguous() or cos_sin_cache.dim() != 2 or not positions.is_contiguous():
        raise ValueError("cos_sin_cache must be a contiguous 2-D table and pos_ids contiguous")
    if positions.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"pos_ids must be int32 or int64, got {positions.dtype}")
    if q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2] or positions.shape != (q.shape[0],):
        raise ValueError("q, k and pos_ids disagree on tokens or head_dim")
    if not is_neox or cos_sin_cache.shape[1] != head_size:
        raise NotImplementedError("the stand-in covers neox RoPE over the whole head only")
    if len({q.device, k.device, positions.device, cos_sin_cache.device}) != 1:
        raise ValueError("q, k, pos_ids and cos_sin_cache on different devices")
    half = head_size // 2
    table = cos_sin_cache[positions.long()][:, None, :]  # the kernel reads past the table unchecked
    cos, sin = table[..., :half], table[..., half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        x.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype))


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None,
                 enable_pdl: bool | None = None) -> torch.Tensor:
    if input.shape[-1] % 2:
        raise ValueError("The last dimension must be even (2 * hidden_size).")
    _half(input)
    if not input.is_contiguous():
        raise ValueError("silu_and_mul's kernel indexes rows as dense: a strided input is misread")
    d = input.shape[-1] // 2
    if out is None:
        out = torch.empty(input.shape[:-1] + (d,), dtype=input.dtype, device=input.device)
    gate, up = input[..., :d].float(), input[..., d:].float()
    out.copy_((gate / (1 + torch.exp(-gate)) * up).to(out.dtype))
    return out


def modules() -> dict[str, types.ModuleType]:
    """flashinfer.norm, flashinfer.rope and flashinfer.activation, as install() registers them."""
    found = {}
    for name, fns in (("norm", (rmsnorm, fused_add_rmsnorm)), ("rope", (apply_rope_with_cos_sin_cache_inplace,)),
                      ("activation", (silu_and_mul,))):
        mod = types.ModuleType(f"flashinfer.{name}")
        for fn in fns:
            setattr(mod, fn.__name__, fn)
        found[name] = mod
    return found
