"""The rotary embedding's cos/sin table (neox-style, rotate-half RoPE). The layer ops apply it
(layer_ops.py, flashinfer_ops.py); the models build it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def _inv_freq(hf_config: Any, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor, using transformers' own RoPE
    initialisers so every `rope_scaling` type it knows (linear, llama3, yarn...)
    is handled exactly as the reference does."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope changes with sequence length; not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    return inv_freq.float(), float(factor)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq, factor = _inv_freq(hf_config, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_positions, head_dim)
        self.register_buffer("cos", emb.cos() * factor, persistent=False)
        self.register_buffer("sin", emb.sin() * factor, persistent=False)
