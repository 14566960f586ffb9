"""A CPU decode step with each decoder layer in one kernel call (csrc/decode_layer_cpu.cpp).

The layer's modules (llama.py) call the same CPU kernels one by one from Python: the norms, the
small-rows linears (fp32 panels, bf16 streamed), RoPE, the K/V store and the paged decode
attention, with module calls, views and splits in between: ~20 Python-level ops a layer.
`decode_layer` runs the same kernels in the same order on the same tensors, so a step is the
same bits either way (tests/engine/test_fused_decode.py), without them: the smollm2 fp32 step
ran 1.41x faster at batch 1, 1.10x at 64 (docs/benchmarks.md, "One call per decoder layer").

It takes over a forward only where that holds:
- at load (`FusedDecode.build`): fp32 or bf16, the cpu-kernels layer ops, dense MLPs, one rank,
  and every linear of the layers with its small-rows form (PackedLinear: `cpu_stream_linears`);
- per step: a decode batch within that form's row limit (fp32 64 with the AVX-512 kernels and 8
  with AVX2, bf16 4), whose attention the backend hands over (`AttentionBackend.paged_decode`:
  the torch backend's decode kernel over an unscaled pool).
Everything else runs the modules.
"""

from __future__ import annotations

import torch

from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.kernels import cpu_kernels
from tandem.engine.kvcache.kv_slots import PagedDecode
from tandem.engine.models.layer_ops import RopeBatch
from tandem.engine.models.layers import GatedMLP, PackedLinear

_NONE = torch.empty(0)


def _small_form(linear: torch.nn.Module) -> torch.Tensor | None:
    return linear.small if isinstance(linear, PackedLinear) else None


class FusedDecode:
    """The decoder layers' weights as `decode_layer` takes them, and the loop over them."""

    def __init__(self, layers: list[tuple[list[torch.Tensor], torch.Tensor | None]], max_rows: int,
                 heads: tuple[int, int, int], eps: float) -> None:
        self.layers = layers
        self.max_rows = max_rows  # the small-rows forms' limit (PackedLinear.small_rows)
        self.heads = heads  # this rank's q heads, kv heads, head_dim
        self.eps = eps

    @classmethod
    def build(cls, model: torch.nn.Module) -> FusedDecode | None:
        """For a llama.LlamaForCausalLM whose layers the kernel can run whole, else None."""
        cfg = model.cfg
        dtype = model.embed_tokens.weight.dtype
        if (model.ops.name != "cpu-kernels" or model.tp.size != 1 or dtype not in (torch.float32, torch.bfloat16)
                or not cpu_kernels.available()):
            return None
        layers, rows = [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, GatedMLP):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            small = [_small_form(m) for m in linears]
            if any(w is None for w in small):
                return None
            rows += [m.small_rows for m in linears]
            norms = (attn.q_norm.weight, attn.k_norm.weight) if cfg.qk_norm else (_NONE, _NONE)
            weights = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight, *small, *norms]
            layers.append(([w.detach() for w in weights], attn.qkv_proj.bias))
        return cls(layers, min(rows), (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim), cfg.rms_norm_eps)

    def __call__(self, x: torch.Tensor, rope: RopeBatch, batch: ForwardBatch,
                 paged: PagedDecode) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder layers over the embedded tokens x: (hidden, residual), as the module loop returns them."""
        hq, hkv, dim = self.heads
        residual = torch.empty_like(x)
        for i, (weights, bias) in enumerate(self.layers):
            if batch.kv_ready is not None:  # KV-tier copies still landing: this layer's must be in
                batch.kv_ready.wait(i)
            x = cpu_kernels.decode_layer(
                x, residual, i == 0, weights, bias, rope.positions, rope.cos, rope.sin, paged.k_buffers[i],
                paged.v_buffers[i], paged.loc, paged.req_to_token, paged.rows, paged.seq_lens, hq, hkv, dim,
                self.eps, paged.scale,
            )
        return x, residual
