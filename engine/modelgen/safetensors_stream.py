"""Write float32 safetensors one tensor at a time.

safetensors' own writers take every tensor at once; a converted checkpoint then sits in
memory whole, at float32. The format needs only the names and shapes up front (the header
holds each tensor's byte range), so the header is written first and each tensor's bytes are
appended as it is produced: memory holds one tensor. Shards and the index follow the HF
layout (model.safetensors, or model-0000i-of-0000n.safetensors + model.safetensors.index.json).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

MAX_SHARD_BYTES = 2 * 10**9
INDEX = "model.safetensors.index.json"


def write_float32(out: Path, specs: Sequence[tuple[str, tuple[int, ...]]],
                  produce: Callable[[str], np.ndarray], max_shard_bytes: int = MAX_SHARD_BYTES) -> None:
    """Write the tensors `specs` names (in that order) under `out`; `produce(name)` makes each
    one when its turn comes and must give exactly the shape promised."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = 4 * math.prod(shape)
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for file, shard in zip(files, shards):
        _write_shard(out / file, shard, produce)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(4 * math.prod(s) for _, s in specs)},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name, _ in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _write_shard(path: Path, shard: list[tuple[str, tuple[int, ...]]], produce: Callable[[str], np.ndarray]) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    start = 0
    for name, shape in shard:
        end = start + 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for name, shape in shard:
            t = np.ascontiguousarray(produce(name), dtype="<f4")
            if t.shape != shape:
                raise ValueError(f"{name}: produced shape {t.shape}, promised {shape}")
            f.write(memoryview(t).cast("B"))
            del t  # before the next one is made
