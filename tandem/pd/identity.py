"""A worker's PD identity: what a peer must share with it to take its KV pages."""

from __future__ import annotations

from tandem.engine.modelgen.model_id import model_id
from tandem.pd.protocol import PD_VERSION, Identity
from tandem.protocol.kv_layout import KVLayout

__all__ = ["identity_of", "model_id"]


def identity_of(layout: KVLayout, deterministic: bool, model_path: str, kv_scales: str = "unit") -> Identity:
    """`kv_scales`: the pool's KVScales.digest()."""
    return Identity(PD_VERSION, model_id(model_path), layout.dtype, layout.page_size, layout.num_layers,
                    layout.total_heads, layout.head_dim, bool(deterministic), kv_scales)
