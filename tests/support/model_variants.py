"""Model directories made from a built preset for one test: the preset's files linked, plus
what the variant adds."""

from __future__ import annotations

import json
from pathlib import Path


def with_kv_scales(src: Path, dst: Path, k: float, v: float) -> Path:
    """`src`'s model with a per-layer K and V scale in a second safetensors file, as a checkpoint
    calibrated for an fp8 KV cache carries them (`model.layers.<i>.self_attn.k_scale`)."""
    import torch
    from safetensors.torch import save_file

    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    save_file({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(s) for i in range(layers)
               for n, s in (("k", k), ("v", v))}, str(dst / "kv_scales.safetensors"))
    return dst
