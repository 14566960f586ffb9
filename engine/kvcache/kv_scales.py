"""Per-tensor scales of an fp8 KV cache: what a layer's K and V are divided by before they are
stored as fp8, and multiplied by when attention reads them back.

    stored = fp8(k / k_scale)            (memory_pool.set_kv)
    scores = q . stored * (scaling * k_scale)     out = (softmax @ stored_v) * v_scale

so attention never materialises the rescaled KV: the K scale folds into the softmax scale and
the V scale into the output, as FlashInfer's fp8 kernels take them.

A checkpoint calibrated for an fp8 KV cache carries one scale a layer for K and one for V, under
the names vLLM reads (`self_attn.k_scale` / `v_scale`, the older `self_attn.kv_scale` for both,
ModelOpt's `k_proj.output_scale` / `v_proj.output_scale`, and `k_proj.k_scale` / `v_proj.v_scale`).
A layer without one gets 1.0, the peers' default. They matter only for an fp8 pool; a
bf16 pool ignores them. A PD pair must agree on them as on the dtype (`digest`, in the identity).

A scale is a number from a file: it must be finite and positive, or the load fails.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass

_SCALE = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\."
                    r"(?:(k|v|kv)_scale|(k|v)_proj\.(?:output_scale|(k|v)_scale))$")
MAX_SCALE = 1e6  # fp8 e4m3 holds up to 448: a larger scale only ever comes from a broken file


def kv_scale_weight(name: str) -> tuple[int, str] | None:
    """For a checkpoint tensor that is a KV scale: (layer, "k" | "v" | "kv"), else None."""
    m = _SCALE.match(name.removesuffix(".weight") if name.endswith("_scale.weight") else name)
    if m is None:
        return None
    layer, direct, proj, named = m.groups()
    if named is not None and named != proj:  # k_proj.v_scale: not a name any exporter writes
        return None
    return int(layer), direct or proj


@dataclass(frozen=True)
class KVScales:
    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    @classmethod
    def from_checkpoint(cls, found: dict[tuple[int, str], float], num_layers: int) -> KVScales:
        """`found`: (layer, "k" | "v" | "kv") -> value, as kv_scale_weight named them."""
        k, v = [1.0] * num_layers, [1.0] * num_layers
        for (layer, which), value in sorted(found.items(), key=lambda kv: kv[0][1] != "kv"):  # kv first
            if not 0 <= layer < num_layers:
                raise ValueError(f"a KV scale for layer {layer}, but the model has {num_layers} layers")
            if not (math.isfinite(value) and 0 < value <= MAX_SCALE):
                raise ValueError(f"layer {layer}'s {which}_scale is {value!r}: "
                                 f"a KV scale must be in (0, {MAX_SCALE:g}]")
            if which in ("k", "kv"):
                k[layer] = value
            if which in ("v", "kv"):
                v[layer] = value
        return cls(tuple(k), tuple(v))

    @property
    def unit(self) -> bool:
        return all(s == 1.0 for s in (*self.k, *self.v))

    def digest(self) -> str:
        """What a PD peer compares: "unit" for all 1.0, else a hash of every scale."""
        if self.unit:
            return "unit"
        return hashlib.sha256(repr((self.k, self.v)).encode()).hexdigest()[:16]
