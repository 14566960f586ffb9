"""A worker's PD identity: what a peer must share with it to take its KV pages."""

from __future__ import annotations

import hashlib
from pathlib import Path

from tandem.pd.protocol import PD_VERSION, Identity
from tandem.protocol.kv_layout import KVLayout


def model_id(model_path: str) -> str:
    """A hash of the model's config and its weights' index (names and sizes, not contents:
    hashing gigabytes at start-up is too slow, and a changed checkpoint changes a size or the
    index). Two directories holding the same model give the same id."""
    root = Path(model_path)
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors.index.json"):
        if (root / name).is_file():
            h.update(name.encode() + b"\0" + (root / name).read_bytes())
    for f in sorted(root.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def identity_of(layout: KVLayout, deterministic: bool, model_path: str, kv_scales: str = "unit") -> Identity:
    """`kv_scales`: the pool's KVScales.digest()."""
    return Identity(PD_VERSION, model_id(model_path), layout.dtype, layout.page_size, layout.num_layers,
                    layout.total_heads, layout.head_dim, bool(deterministic), kv_scales)
