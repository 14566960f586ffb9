"""What identifies a model on disk, for anything that must not mix two models' KV: the PD
handshake (tandem/pd/identity.py) and the disk KV tier (engine/kvcache/disk_tier.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path


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
