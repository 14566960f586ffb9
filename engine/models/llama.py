"""The Llama-family decoder: Llama 2/3, Qwen2 (qkv bias) and Qwen3 (qk-norm).

The three differ only in two switches carried by ModelConfig, so one module
serves all of them. Inputs are flattened tokens with explicit positions; KV
storage and attention are delegated to the attention backend, so the same
module runs prefill, decode and mixed batches.

    hidden (T, H) --qkv_proj--> q (T, Hq, D) | k (T, Hkv, D) | v (T, Hkv, D)
                  [qk-norm] -> RoPE -> backend.forward -> o_proj
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.attention.base import AttentionBackend
from tandem.engine.config import ModelConfig
from tandem.engine.forward_batch import ForwardBatch
from tandem.engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, bucketed


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.cfg = cfg
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        cfg = self.cfg
        q, k, v = self.qkv_proj(x).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(-1, cfg.num_heads, cfg.head_dim)
        k = k.view(-1, cfg.num_kv_heads, cfg.head_dim)
        v = v.view(-1, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(cos_sin, q, k)
        return self.o_proj(backend.forward(q, k, v, self.layer_id, batch))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, layer_id)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos_sin, backend, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with torch.device("cpu"):  # real tables even when the model is built on meta
            self.rope = RotaryEmbedding(cfg.hf_config, cfg.head_dim, max_positions)
        if cfg.tie_word_embeddings:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, batch: ForwardBatch, backend: AttentionBackend) -> torch.Tensor:
        """Logits (fp32) of the last new token of every request: (batch, vocab)."""
        x = self.embed_tokens(batch.input_ids)
        cos_sin = self.rope.lookup(batch.positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos_sin, backend, batch)
        # Only the last token of each request is sampled, so norm + lm_head run on those rows.
        x = self.norm(x[batch.logits_indices])
        head = lambda h: torch.nn.functional.linear(h, self.lm_head.weight)  # noqa: E731
        logits = bucketed(head, x) if x.device.type == "cpu" else head(x)
        return logits.float()
