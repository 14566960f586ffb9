"""Which layer ops (layer_ops.py) a runner uses: the fused kernels of its device where they run
the model, else HF's torch chain; an explicit choice that cannot run is refused at start-up."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from tandem.engine.attention import flashinfer_limits
from tandem.engine.models.layer_ops import TORCH, CpuKernelOps, LayerOps

if TYPE_CHECKING:
    from tandem.engine.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

NAMES = ("auto", "torch", "cpu-kernels", "flashinfer")


def choose(name: str, device_type: str, dtype: torch.dtype, head_dim: int, have_flashinfer: bool,
           cpu_supported: bool) -> str:
    """The ops to build: `auto` takes the fused kernels of the device where they run this
    model (FlashInfer on CUDA, the CPU kernels on CPU), else torch; an explicit choice that
    cannot run is a ValueError at start-up. `cpu_supported`: the CPU kernels are built and
    handle this model's shapes (cpu_kernels.supports_layer_ops)."""
    if name not in NAMES:
        raise ValueError(f"unknown layer_ops {name!r}; choose one of {NAMES}")
    fi_limits = flashinfer_limits(dtype, head_dim) + ([] if have_flashinfer else ["flashinfer is not installed"])
    if name == "auto":
        if device_type == "cuda":
            return "torch" if fi_limits else "flashinfer"
        return "cpu-kernels" if device_type == "cpu" and cpu_supported else "torch"
    if name == "flashinfer" and (device_type != "cuda" or fi_limits):
        raise ValueError(f"layer_ops=flashinfer cannot run here: {'; '.join(fi_limits) or 'needs CUDA'}")
    if name == "cpu-kernels" and (device_type != "cpu" or not cpu_supported):
        raise ValueError("layer_ops=cpu-kernels cannot run here: needs a CPU whose kernels are built "
                         "and a model they handle (cpu_kernels.supports_layer_ops)")
    return name


def build(name: str, model: LlamaForCausalLM, fall_back: bool = False) -> LayerOps:
    """An implementation chosen by `choose`, ready for `model`. FlashInfer's ops run once on
    the model's device and shapes first, so that a kernel that cannot build here (FlashInfer
    JIT-compiles them on first use) fails at start-up, never mid-forward: with `fall_back`
    (layer_ops=auto) the model then keeps the torch ops, else it is a ValueError."""
    if name == "cpu-kernels":
        return CpuKernelOps()
    if name != "flashinfer":
        return TORCH
    from tandem.engine.models.flashinfer_ops import FlashInferLayerOps

    try:
        ops = FlashInferLayerOps(model.rope)
        ops.warm_up(model.cfg.hidden_size, model.cfg.intermediate_size, model.layers[0].self_attn.heads,
                    model.embed_tokens.weight)
    except Exception as exc:  # an import, a JIT build or a launch: this machine cannot run them
        if not fall_back:
            raise ValueError(f"layer_ops=flashinfer cannot run here: {type(exc).__name__}: {exc}") from exc
        log.warning("FlashInfer's layer ops failed their warm-up, using the torch ops: %s: %s",
                    type(exc).__name__, exc)
        return TORCH
    return ops
