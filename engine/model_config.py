"""Frozen configuration for the model runner.

`ModelConfig` is read once from a HF `config.json` (ours or a real Qwen/Llama
checkpoint) and carries only what the native model needs. `RunnerConfig` holds
the memory and kernel knobs; its names follow SGLang's server args.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Architectures the native model implements, with the features each turns on.
_ARCH_FEATURES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {"qkv_bias": False, "qk_norm": False},
    "Qwen2ForCausalLM": {"qkv_bias": True, "qk_norm": False},
    "Qwen3ForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "Qwen3MoeForCausalLM": {"qkv_bias": False, "qk_norm": True},
    "MixtralForCausalLM": {"qkv_bias": False, "qk_norm": False},
}


@dataclass(frozen=True)
class ModelConfig:
    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    torch_dtype: str
    eos_token_ids: tuple[int, ...]
    hf_config: Any = field(repr=False, compare=False, hash=False)
    # Mixture of experts (models/moe.py; 0 experts: a dense model). The experts' intermediate
    # size is its own (a rank's share under TP); `sparse_layers` are the layers whose MLP is
    # the experts (Qwen3-MoE's decoder_sparse_step and mlp_only_layers; every layer in Mixtral).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    sparse_layers: tuple[int, ...] = ()
    # Set on a tensor-parallel rank's view (`for_rank`): the heads, intermediate size and
    # vocabulary rows above are then this rank's, and `shard` says which (parallel/shard.py).
    shard: Any = field(default=None, repr=False, compare=False, hash=False)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def mlp_width_gcd(self) -> int:
        """The widths SiLU*mul runs on, dense and expert, as one number for a divisibility check."""
        import math

        return math.gcd(self.intermediate_size, self.moe_intermediate_size)

    @property
    def tp_size(self) -> int:
        return 1 if self.shard is None else self.shard.size

    @property
    def local_experts(self) -> tuple[int, ...]:
        """The experts this rank holds: all of them but under expert parallelism."""
        held = None if self.shard is None else self.shard.experts
        return tuple(range(self.num_experts)) if held is None else held

    def for_rank(self, rank: int, size: int, ep_size: int = 1) -> ModelConfig:
        """This config as tensor-parallel rank `rank` of `size` sees it: its own heads, KV heads
        and MLP width (the vocabulary stays whole: the LM head's logits are gathered); with
        `ep_size` (= size) its own experts, whole (parallel/experts.py)."""
        from dataclasses import replace

        from tandem.engine.parallel.experts import contiguous, ep_problem
        from tandem.engine.parallel.shard import plan_shard

        if self.shard is not None:
            raise ValueError("this config is a rank's view already")
        problem = ep_problem(ep_size, size, self.num_experts)
        if problem is not None:
            raise ValueError(problem)
        if size == 1:
            return self
        placement = contiguous(self.num_experts, ep_size) if ep_size > 1 else None
        s = plan_shard(rank, size, self.num_heads, self.num_kv_heads, self.intermediate_size, self.vocab_size,
                       self.moe_intermediate_size, placement)
        return replace(self, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
                       intermediate_size=s.intermediate_size, moe_intermediate_size=s.moe_intermediate_size, shard=s)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(str(path))
        arch = (hf.architectures or ["LlamaForCausalLM"])[0]
        if arch not in _ARCH_FEATURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {sorted(_ARCH_FEATURES)}")
        if getattr(hf, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported yet")
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            path=str(path),
            architecture=arch,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=_ARCH_FEATURES[arch]["qkv_bias"] or bool(getattr(hf, "attention_bias", False)),
            qk_norm=_ARCH_FEATURES[arch]["qk_norm"],
            torch_dtype=str(getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None) or "float32"),
            eos_token_ids=_eos_ids(Path(path), hf.eos_token_id),
            hf_config=hf,
            **_experts(arch, hf),
        )


def _experts(arch: str, hf: Any) -> dict[str, Any]:
    """The mixture-of-experts fields of ModelConfig, as each architecture's config names them."""
    if arch == "MixtralForCausalLM":
        return {"num_experts": hf.num_local_experts, "num_experts_per_tok": hf.num_experts_per_tok,
                "moe_intermediate_size": hf.intermediate_size, "norm_topk_prob": True,
                "sparse_layers": tuple(range(hf.num_hidden_layers))}
    if arch == "Qwen3MoeForCausalLM":
        step, dense = hf.decoder_sparse_step, set(hf.mlp_only_layers or ())
        sparse = tuple(i for i in range(hf.num_hidden_layers)
                       if i not in dense and hf.num_experts > 0 and (i + 1) % step == 0)
        return {"num_experts": hf.num_experts, "num_experts_per_tok": hf.num_experts_per_tok,
                "moe_intermediate_size": hf.moe_intermediate_size, "norm_topk_prob": bool(hf.norm_topk_prob),
                "sparse_layers": sparse}
    return {}


def _eos_ids(path: Path, config_eos: int | list[int] | None) -> tuple[int, ...]:
    """EOS ids from config.json, widened by generation_config.json as HF `generate` does, and by
    the tokenizer's own eos_token as SGLang does (a chat model's end of turn may be named there only)."""
    ids: list[int] = []
    sources: list[Any] = [config_eos]
    gen = path / "generation_config.json"
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    sources.append(_tokenizer_eos(path))
    for src in sources:
        for i in src if isinstance(src, list) else [src]:
            if i is not None and i not in ids:
                ids.append(int(i))
    return tuple(ids)


def _tokenizer_eos(path: Path) -> int | None:
    """The id of tokenizer_config.json's eos_token, looked up among tokenizer.json's added tokens."""
    cfg_path, tok_path = path / "tokenizer_config.json", path / "tokenizer.json"
    if not (cfg_path.is_file() and tok_path.is_file()):
        return None
    eos = json.loads(cfg_path.read_text()).get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if not isinstance(eos, str):
        return None
    added = json.loads(tok_path.read_text()).get("added_tokens") or []
    return next((int(t["id"]) for t in added if t.get("content") == eos), None)


@dataclass(frozen=True)
class RunnerConfig:
    """Memory and kernel settings of one model runner (SGLang server-arg names)."""

    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda
    page_size: int = 1
    max_total_tokens: int | None = None  # KV pool size in tokens; None = from mem_fraction_static
    mem_fraction_static: float = 0.5  # share of free device memory given to weights + KV pool
    max_running_requests: int = 256
    max_context_len: int | None = None  # None = model's max_position_embeddings
    attention_backend: str = "auto"  # auto | torch | flashinfer
    layer_ops: str = "auto"  # auto | torch | cpu-kernels | flashinfer (models/layer_ops.py)
    # FlashInfer decode: the tensor-core kernel (its prefill kernel) or the CUDA-core one.
    # None: tensor cores once 4 or more query heads share a KV head, as SGLang decides.
    decode_tensor_cores: bool | None = None
    # FlashInfer's tensor-core decode splits each request's KV over several CTAs and merges them.
    # None: split only while the batch leaves SMs idle (attention/split_kv.py); False: never.
    decode_split_kv: bool | None = None
    # RoPE and the layer's K/V store in one Triton launch (kvcache/rope_kv_triton.py), with the
    # FlashInfer layer ops. None: where Triton runs (CUDA).
    fused_rope_kv: bool | None = None
    disable_cuda_graph: bool = False
    cpu_packed_linear: bool = True  # bf16 and fp32 on CPU: oneDNN-packed weights (models/layers.py)
    # Packed linears also keep a second form of their weight for calls of few rows, run by the CPU
    # kernels (layers.PackedLinear): bf16 streams the plain weight for up to 4 rows (1.5-2x oneDNN
    # there), fp32 its panels for up to 64 (1.05-1.35x the step). The price is that second copy.
    # None: when the copy is at most STREAM_COPY_MAX_GIB.
    cpu_stream_linears: bool | None = None
    # A request's tokens do not depend on its batch, its cache hits or its chunks (docs/engine.md,
    # "Deterministic mode"): fixed-shape matmuls (models/batch_invariant.py), one attention
    # reduction for every token (attention/torch_backend.py), per-row norms, ordered TP sums.
    deterministic: bool = False
    ep_size: int = 1  # expert parallelism over the TP group's ranks (parallel/experts.py)
    kv_cache_dtype: str = "auto"  # auto | fp8_e4m3 | fp8_e5m2 (kvcache/kv_memory.py: kv_storage_dtype)
    cuda_graph_max_bs: int | None = None  # None: every decode batch up to max_running_requests
    # The largest forward the scheduler runs (its prefill chunk): sizes the activation reserve.
    max_forward_tokens: int = 8192

    def __post_init__(self) -> None:
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two >= 1, got {self.page_size}")
        if not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError("cuda_graph_max_bs must be >= 1 (disable_cuda_graph turns graphs off)")

    @property
    def graph_max_bs(self) -> int:
        """The largest decode batch captured in a CUDA graph: larger ones run eager."""
        cap = self.max_running_requests if self.cuda_graph_max_bs is None else self.cuda_graph_max_bs
        return min(cap, self.max_running_requests)
