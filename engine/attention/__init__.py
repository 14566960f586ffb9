"""Attention backends behind one contract (see base.py), and the choice between them.

The choice is made once, when the runner attaches its KV memory, so that a model
the chosen kernels cannot run is refused at start-up, never mid-forward.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from tandem.engine.attention.base import AttentionBackend

log = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "flashinfer")
# What FlashInfer's paged prefill/decode kernels are built for: half-precision q/KV only
# (no fp32 kernels exist) and these head dims (head_dim 32 fails its kernel configuration).
FLASHINFER_HEAD_DIMS = frozenset({64, 128, 256})
FLASHINFER_DTYPES = frozenset({torch.bfloat16, torch.float16})


def flashinfer_limits(dtype: torch.dtype, head_dim: int) -> list[str]:
    """Why FlashInfer cannot run this model ([] when it can)."""
    why = []
    if dtype not in FLASHINFER_DTYPES:
        why.append(f"dtype {str(dtype).removeprefix('torch.')} (FlashInfer has bfloat16/float16 kernels only)")
    if head_dim not in FLASHINFER_HEAD_DIMS:
        why.append(f"head_dim {head_dim} (FlashInfer supports {sorted(FLASHINFER_HEAD_DIMS)})")
    return why


def flashinfer_installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


def choose_backend(name: str, device_type: str, dtype: torch.dtype, head_dim: int,
                   have_flashinfer: bool) -> str:
    """The backend to build: `auto` takes FlashInfer on CUDA where it can run the model, else
    torch (SDPA, any dtype and head_dim); an explicit choice that cannot run is a ValueError."""
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKENDS}")
    limits = flashinfer_limits(dtype, head_dim)
    if name == "auto":
        if device_type != "cuda":
            return "torch"
        if limits or not have_flashinfer:
            log.info("attention backend: torch on CUDA, because FlashInfer %s",
                     "cannot run " + " and ".join(limits) if limits else "is not installed")
            return "torch"
        return "flashinfer"
    if name == "flashinfer":
        if device_type != "cuda":
            raise ValueError(f"attention_backend=flashinfer needs a CUDA device, not {device_type}")
        if limits:
            raise ValueError("attention_backend=flashinfer cannot run this model: " + "; ".join(limits)
                             + ". Use attention_backend=auto or torch.")
        if not have_flashinfer:
            raise ValueError("attention_backend=flashinfer: flashinfer is not installed (pip install tandem[gpu])")
    return name


def create_backend(name: str, runner_ctx: object) -> AttentionBackend:
    """`name` is auto | torch | flashinfer (see choose_backend)."""
    ctx = runner_ctx
    chosen = choose_backend(name, torch.device(ctx.device).type, ctx.kv_pool.dtype,  # type: ignore[attr-defined]
                            ctx.head_dim, flashinfer_installed())  # type: ignore[attr-defined]
    if chosen == "torch":
        from tandem.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(runner_ctx)
    from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend

    return FlashInferAttentionBackend(runner_ctx)


__all__ = ["AttentionBackend", "choose_backend", "create_backend", "flashinfer_installed"]
