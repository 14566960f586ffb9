"""The Llama-family decoder: Llama 2/3, Qwen2 (qkv bias) and Qwen3 (qk-norm), and their
mixture-of-experts forms, Qwen3-MoE and Mixtral (a layer's MLP is then moe.py's experts).

They differ only in switches carried by ModelConfig, so one module serves all of them.
Inputs are flattened tokens with explicit positions; KV storage and attention are delegated
to the attention backend, so the same module runs prefill, decode and mixed batches.

    hidden (T, H) --qkv_proj--> q (T, Hq, D) | k (T, Hkv, D) | v (T, Hkv, D)
                  [qk-norm] -> RoPE -> backend.forward -> o_proj
                               (RoPE + the K/V store in one kernel where the ops and backend fuse them)

The norms, SiLU*mul and qk-norm + RoPE go through the model's layer ops (layer_ops.py):
HF's torch chain, or the fused kernels of the device.

Layers pass a residual stream (SGLang's style): each norm after the first adds
the residual in the same pass, which the fused ops do in place.

    x, r = input_layernorm(x, r)   # r += x; x = norm(r)
    x = self_attn(x)
    x, r = post_attention_layernorm(x, r)
    x = mlp(x)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.kvcache.kv_scales import KVScales
from tandem.engine.model_config import ModelConfig
from tandem.engine.models.fused_decode import FusedDecode
from tandem.engine.models.layer_ops import TORCH, Heads, LayerOps, RopeBatch
from tandem.engine.models.layers import (
    STREAM_ROWS,
    GatedMLP,
    PackedLinear,
    RMSNorm,
    bucketed,
    row_bucket,
    small_rows_form,
)
from tandem.engine.models.moe import SparseMoE
from tandem.engine.models.rotary import RotaryEmbedding
from tandem.engine.parallel.group import SINGLE, TPGroup


class Attention(nn.Module):
    ops: LayerOps = TORCH  # qk-norm + RoPE on the qkv rows

    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.tp = tp  # cfg's heads are this rank's: qkv is column-parallel, o row-parallel
        self.heads = Heads(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeBatch,
        backend: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        cfg = self.cfg
        qkv = self.qkv_proj(x)
        # Rows past the batch's tokens are CPU row-bucket padding (see LlamaForCausalLM.forward):
        # they go through the matmuls but never reach RoPE, attention or the KV pool.
        n = batch.num_tokens
        qn, kn = (self.q_norm.weight, self.k_norm.weight) if cfg.qk_norm else (None, None)
        # Layer ops that fuse RoPE with the K/V store write k and v into the slots the backend
        # offers (one launch instead of two); otherwise the backend stores them.
        if batch.kv_ready is not None:  # KV-tier copies still landing: this layer's must be in
            batch.kv_ready.wait(self.layer_id)
        slots = backend.kv_slots(self.layer_id, batch) if self.ops.fuses_kv_store else None
        if slots is None:
            q, k, v = self.ops.qk_rope(qkv[:n], rope, self.heads, qn, kn, cfg.rms_norm_eps)
        else:
            q, k, v = self.ops.qk_rope_store(qkv[:n], rope, self.heads, qn, kn, cfg.rms_norm_eps, slots)
        o = backend.forward(q, k, v, self.layer_id, batch, kv_stored=slots is not None)
        if qkv.shape[0] != n:
            o = F.pad(o, (0, 0, 0, qkv.shape[0] - n))
        return self.tp.all_reduce(self.o_proj(o))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id, tp)
        self.mlp: GatedMLP | SparseMoE
        if layer_id in cfg.sparse_layers:
            self.mlp = SparseMoE(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts,
                                 cfg.num_experts_per_tok, cfg.norm_topk_prob, tp, cfg.local_experts)
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeBatch,
        backend: AttentionBackend,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(x, rope, backend, batch)
        x, residual = self.post_attention_layernorm.add_forward(x, residual)
        if isinstance(self.mlp, SparseMoE):  # routes the batch's tokens only, not the CPU row padding
            return self.mlp(x, batch.num_tokens), residual
        return self.mlp(x), residual


class LlamaForCausalLM(nn.Module):
    ops: LayerOps = TORCH

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        # Under tensor parallelism the embedding and the LM head hold this rank's vocabulary
        # rows (cfg.shard.vocab), padded past the vocabulary with zero rows.
        rows = cfg.vocab_size if cfg.shard is None else cfg.shard.vocab_rows
        # An explicit (uninitialised) weight: Embedding's own normal_ init would import
        # torch._dynamo (~2 s of every scheduler start) to fill values the loader overwrites.
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.kv_scales = KVScales.ones(cfg.num_layers)  # an fp8 KV cache's; the loader sets the checkpoint's
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with torch.device("cpu"):  # real tables even when the model is built on meta
            self.rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
        self.packed_head: PackedLinear | None = None
        self.fused_decode: FusedDecode | None = None  # set by use_layer_ops where the CPU kernel runs whole layers

    def pack_lm_head(self, stream: bool = False) -> None:
        """CPU bf16: the LM head through a oneDNN-packed weight (2x the plain matmul at
        decode batch 64). Tied, that is a copy beside the embedding; untied, it replaces it.
        With `stream`, few rows take the weight's small-rows form (layers.PackedLinear): tied and
        bf16, that is the embedding itself, no copy; fp32 panels are a copy either way."""
        weight = self.lm_head.weight
        tied = self.lm_head is self.embed_tokens
        small = small_rows_form(weight) if stream else None
        shared = small is not None and small.data_ptr() == weight.data_ptr()
        self.packed_head = PackedLinear(weight, small=small, owns_small=not (tied and shared))
        if not tied:
            self.lm_head = self.packed_head

    def use_layer_ops(self, ops: LayerOps) -> None:
        """Route norms, SiLU*mul and qk-norm + RoPE through `ops` (layer_ops_choice.build)."""
        for mod in self.modules():
            if isinstance(mod, (RMSNorm, GatedMLP, SparseMoE, Attention)):
                mod.ops = ops
        self.ops = ops
        self.fused_decode = FusedDecode.build(self)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Logits (fp32) of the last new token of every request: (batch, vocab)."""
        ids = batch.input_ids
        # CPU bf16/fp16 matmuls run in oneDNN, which compiles a kernel per shape: pad the rows
        # once to its bucket (row_bucket) so that no matmul of the forward needs its own padded
        # copy; RoPE, attention and the KV pool see the real rows. fp32 runs in the BLAS, which
        # compiles nothing, and padding would only add rows: a decode step of one request
        # padded to 8 took 3-4x as long (MKL sgemm on an AMD EPYC, 2 threads).
        # A row or two are not padded: their matmuls may stream the weight instead (STREAM_ROWS).
        bucket = (ids.device.type == "cpu" and self.embed_tokens.weight.dtype != torch.float32
                  and ids.shape[0] > STREAM_ROWS)
        if bucket:
            ids = F.pad(ids, (0, row_bucket(ids.shape[0]) - ids.shape[0]))
        x = self.embed(ids)
        rope = self.ops.rope_batch(self.rope, batch.positions, x.dtype)
        paged = None
        if self.fused_decode is not None and ids.shape[0] <= self.fused_decode.max_rows:
            paged = backend.paged_decode(batch)
        if paged is not None:  # a CPU decode step: each layer in one kernel call (fused_decode.py)
            x, residual = self.fused_decode(x, rope, batch, paged)
        else:
            residual = None
            for layer in self.layers:
                x, residual = layer(x, residual, rope, backend, batch)
        # Only the last token of each request is sampled, so norm + lm_head run on those rows.
        idx = batch.logits_indices
        x, _ = self.norm.add_forward(x[idx], residual[idx])
        if self.packed_head is not None:
            logits = self.packed_head(x)
        else:
            head = lambda h: torch.nn.functional.linear(h, self.lm_head.weight)  # noqa: E731
            logits = bucketed(head, x) if bucket else head(x)
        if self.cfg.shard is not None:  # each rank's vocabulary columns, in rank order
            logits = self.tp.all_gather(logits)[:, : self.cfg.vocab_size]
        return logits.float()

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; under tensor parallelism each rank looks up the ids in its rows,
        zeroes the others, and the sum over ranks is the whole lookup."""
        if self.cfg.shard is None:
            return self.embed_tokens(ids)
        lo, hi = self.cfg.shard.vocab
        mine = (ids >= lo) & (ids < hi)
        x = self.embed_tokens((ids - lo) * mine)
        return self.tp.all_reduce(x * mine.unsqueeze(-1).to(x.dtype))
