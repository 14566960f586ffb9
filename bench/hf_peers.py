"""The HF transformers peers gpu_decode.py times the Engine against.

`hf`: generate() as most users call it, a DynamicCache and the eager forward. `hf_static`:
HF's own recipe for fast generation, a StaticCache (`cache_implementation="static"`) with the
decode forward under torch.compile. In transformers 5.x generate() compiles that forward itself
when the cache is static and the model is on CUDA (`_valid_auto_compile_criteria`, through
`get_compiled_call(compile_config)`; read in the 5.17 source, the GPU image's version, and 5.24):
the prefill stays eager, every decode step runs the compiled call. `compile_config` is the
documented knob; `CompileConfig()`'s defaults are mode="reduce-overhead" (CUDA graphs) and
fullgraph=False, so a graph break costs speed rather than the peer. On CPU it may run uncompiled
(`eager`, disable_compile=True), which keeps the code path testable without a compile.

A static cache is sized prompt + max_new_tokens and never shrinks between calls
(`_previous_max_cache_length`), so after a warm-up at the timed shape every call reuses the
compiled graphs: one compile per batch size, all inside the warm-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

MODES = ("auto", "compiled", "eager", "off")


@dataclass(frozen=True)
class HFPeer:
    name: str  # the prefix of its keys in a result row
    cache: str  # "dynamic" | "static"
    compile: bool  # torch.compile of the decode forward (static only)

    def generate(self, hf: Any, ids: torch.Tensor, n: int) -> torch.Tensor:
        """Exactly `n` new tokens for every row, greedy, no padding."""
        kw: dict[str, Any] = {}
        if self.cache == "static":
            from transformers import CompileConfig

            kw = {"cache_implementation": "static"}
            kw |= {"compile_config": CompileConfig()} if self.compile else {"disable_compile": True}
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, pad_token_id=hf.generation_config.pad_token_id, **kw)

    def describe(self, hf: Any) -> dict[str, Any]:
        """What ran: whether generate() really built a compiled call is read off the model."""
        out: dict[str, Any] = {"cache": self.cache, "compile_requested": self.compile}
        if self.compile:
            from transformers import CompileConfig

            out["compile_config"] = CompileConfig().to_dict()
            out["compiled"] = hasattr(hf, "_compiled_call")
        return out


def hf_peers(static: str, device_type: str) -> list[HFPeer]:
    """The peers for `--hf-static` (auto: compiled on CUDA, none on CPU, where a compile takes
    minutes and measures nothing the GPU run needs)."""
    if static not in MODES:
        raise ValueError(f"--hf-static must be one of {MODES}, got {static!r}")
    if static == "auto":
        static = "compiled" if device_type == "cuda" else "off"
    peers = [HFPeer("hf", "dynamic", False)]
    if static != "off":
        peers.append(HFPeer("hf_static", "static", static == "compiled"))
    return peers
