"""ModelSpec, the built-in presets, and deterministic random weights.

The random weights are scaled so the model's next-token distribution is peaked (logit std
around 4.5, wide top-1/top-2 gaps), so greedy decoding by two implementations agrees token
for token. model_builder.py turns a spec into a model directory.

Two ways to draw them (`ModelSpec.init`). `portable`: integer draws turned into floats in exactly
rounded float64 on the CPU, bit-identical on every machine, at about 60 ns a weight on one core
(1-2 minutes for the 1.2B-parameter shape, about ten for 8B). `device`: torch's own generator on
the device the build runs on (CUDA where there is one), the same scales and distributions, about
a second for 8B on a GPU; reproducible on one kind of device and torch version, not across them.
The `*-shape` presets time kernels, for which the values' scales matter and their last bits do
not, so they draw on the device; the presets that tests compare token for token stay portable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

BUILDER_VERSION = 2

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# Mixture-of-experts architectures the builder makes (their GGUF import is not supported yet).
MOE_ARCHITECTURES = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
BUILDER_ARCHITECTURES = {**ARCHITECTURES, **MOE_ARCHITECTURES}
REQUIRED_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)

# Weight scales, chosen so the random model's next-token distribution is peaked.
# Final hidden states are RMS-normalised to ~1 per element, so a logit's std is
# sqrt(hidden) * (output row std): row std = LOGIT_STD / sqrt(hidden).
LOGIT_STD = 4.5
# Each attention / MLP block adds about this RMS to the residual stream, well above the
# embedding's. A stream dominated by the input embedding makes a tied model predict its own
# input token, and greedy decoding degenerates into repeats.
BLOCK_OUT_RMS = 4.0
_SILU_GLU_RMS = 0.6  # RMS of silu(g) * u for unit-normal g, u; down_proj divides it back out
# Output rows get norms exp(TOKEN_NORM_SPREAD * z), z ~ N(0, 1): a fixed per-token prior, like
# real token frequencies. The fatter logit tail widens the top-1/top-2 gap (median ~2 logits vs
# ~0.8 for plain Gaussian logits); a larger spread shrinks the set of likely tokens and
# makes greedy decoding repetitive.
TOKEN_NORM_SPREAD = 0.4
# Norm weights are 1 + noise, so an implementation that skips or misapplies them diverges.
# The final norm's weights also get random signs: for tied embeddings that makes the input
# token's own logit zero-mean rather than biased up by |embedding|^2.
NORM_NOISE_STD = 0.1
BIAS_STD = 0.2  # Qwen2 q/k/v biases
INITS = ("portable", "device")


@dataclass(frozen=True)
class MoESpec:
    """The experts of a mixture-of-experts spec (qwen3_moe, mixtral)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's (Mixtral: also config.json's intermediate_size)
    norm_topk_prob: bool = True  # qwen3_moe's switch; Mixtral always renormalises
    decoder_sparse_step: int = 1  # qwen3_moe: every n-th layer is sparse
    mlp_only_layers: tuple[int, ...] = ()  # qwen3_moe: these layers keep a dense MLP

    def sparse(self, layer: int) -> bool:
        return layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0


@dataclass(frozen=True)
class ModelSpec:
    """Shape and init of a random model; `resolved()` fills the auto fields."""

    arch: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None  # None: hidden_size // num_heads
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    # HF rope scaling dict, e.g. {"rope_type": "linear", "factor": 2.0}; excluded from hash().
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    tie_word_embeddings: bool = False
    seed: int = 0
    rms_norm_eps: float = 1e-6
    dtype: str = "float32"
    init: str = "portable"  # portable | device: how the random weights are drawn (module docstring)
    moe: MoESpec | None = None  # the experts, for the MOE_ARCHITECTURES only

    def __post_init__(self) -> None:
        if self.arch not in BUILDER_ARCHITECTURES:
            raise ValueError(f"arch must be one of {sorted(BUILDER_ARCHITECTURES)}, got {self.arch!r}")
        if (self.moe is not None) != (self.arch in MOE_ARCHITECTURES):
            raise ValueError(f"arch {self.arch!r} {'needs' if self.moe is None else 'takes no'} experts (moe)")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must divide by num_heads when head_dim is not given")
        if self.head_dim is not None and self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.rope_scaling is not None and "rope_type" not in self.rope_scaling:
            raise ValueError("rope_scaling needs a 'rope_type' key")
        if self.init not in INITS:
            raise ValueError(f"init must be one of {INITS}, got {self.init!r}")

    def resolved(self) -> ModelSpec:
        if self.head_dim is not None:
            return self
        return dataclasses.replace(self, head_dim=self.hidden_size // self.num_heads)

    def param_count(self) -> int:
        return sum(math.prod(shape) for shape in weight_shapes(self).values())


_TINY = ModelSpec(
    arch="qwen3",
    hidden_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate_size=768,
    vocab_size=8192,
    rope_theta=1_000_000.0,
    tie_word_embeddings=True,
)
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 512,
}

PRESETS: dict[str, ModelSpec] = {
    "tiny": _TINY,
    # Untied, so the separate lm_head path is covered too.
    "tiny-llama": dataclasses.replace(_TINY, arch="llama", rope_theta=500_000.0, tie_word_embeddings=False),
    "tiny-qwen2": dataclasses.replace(_TINY, arch="qwen2"),
    "tiny-llama-rope": dataclasses.replace(
        _TINY, arch="llama", rope_theta=500_000.0, rope_scaling=_LLAMA3_ROPE
    ),
    # Gemma/Llama shapes of head_dim 256 with 8 query heads per KV head: the decode kernel's
    # widest item (its wrong answers on AVX2 CPUs were invisible on the 64-dim presets).
    "tiny-llama-d256": dataclasses.replace(
        _TINY, arch="llama", num_layers=2, num_heads=16, num_kv_heads=2, head_dim=256,
        rope_theta=500_000.0, tie_word_embeddings=False,
    ),
    # Mixture of experts: 8 experts, top 2, renormalised; layer 1 keeps a dense MLP.
    "tiny-qwen3-moe": dataclasses.replace(
        _TINY, arch="qwen3_moe", moe=MoESpec(num_experts=8, top_k=2, intermediate_size=128, mlp_only_layers=(1,)),
    ),
    "tiny-mixtral": dataclasses.replace(
        _TINY, arch="mixtral", rope_theta=1_000_000.0, tie_word_embeddings=False, intermediate_size=384,
        moe=MoESpec(num_experts=4, top_k=2, intermediate_size=384),
    ),
    # A mixture-of-experts shape for CPU benchmarks (bench/moe_cpu.py): Qwen3-30B-A3B's proportions
    # (top 8 of 128 experts there; top 4 of 32 here), ~0.33B parameters, ~60M active a token.
    "qwen3-moe-small-shape": ModelSpec(
        arch="qwen3_moe", hidden_size=1024, num_layers=8, num_heads=16, num_kv_heads=4, head_dim=64,
        intermediate_size=2816, vocab_size=16384, rope_theta=1_000_000.0, tie_word_embeddings=True,
        dtype="bfloat16", init="device", moe=MoESpec(num_experts=32, top_k=4, intermediate_size=256),
    ),
    # ~152M parameters; for benchmarks.
    "small": ModelSpec(
        arch="llama",
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        vocab_size=16384,
        rope_theta=500_000.0,
        tie_word_embeddings=True,
    ),
    # Llama-3.2-1B's shape (tied embeddings), random weights: ~1.24B parameters, 2.5 GB in bf16;
    # the GPU decode benchmark's model (bench/gpu_decode.py).
    "llama-1b-shape": ModelSpec(
        arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        intermediate_size=8192, vocab_size=128256, rope_theta=500_000.0, max_position_embeddings=8192,
        tie_word_embeddings=True, dtype="bfloat16", init="device",
    ),
    # Llama-3.1-8B's shape (untied, head_dim 128), random weights: ~8.03B parameters, 16 GB in bf16,
    # drawn on the GPU; the decode benchmark's second model. Llama 3.1's rope scaling and 128k
    # context are left out: a decode step's cost does not depend on them, and a shorter context
    # keeps the row table and graph buffers the KV pool is sized around small.
    "llama-8b-shape": ModelSpec(
        arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        intermediate_size=14336, vocab_size=128256, rope_theta=500_000.0, max_position_embeddings=8192,
        tie_word_embeddings=False, dtype="bfloat16", init="device",
    ),
}


def weight_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes exactly as HF's *ForCausalLM expects them for `spec.arch`."""
    spec = spec.resolved()
    assert spec.head_dim is not None
    d, hd, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    q_out, kv_out = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, d)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (d,)
        shapes[p + "self_attn.q_proj.weight"] = (q_out, d)
        shapes[p + "self_attn.k_proj.weight"] = (kv_out, d)
        shapes[p + "self_attn.v_proj.weight"] = (kv_out, d)
        if spec.arch == "qwen2":
            shapes[p + "self_attn.q_proj.bias"] = (q_out,)
            shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        if spec.arch in ("qwen3", "qwen3_moe"):
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        if spec.moe is not None and spec.moe.sparse(i):
            shapes.update(_expert_shapes(spec, p))
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, d)
        shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
    shapes["model.norm.weight"] = (d,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, d)
    return shapes


def _expert_shapes(spec: ModelSpec, p: str) -> dict[str, tuple[int, ...]]:
    """One sparse layer's router and experts, under each architecture's names."""
    assert spec.moe is not None
    d, inter, n = spec.hidden_size, spec.moe.intermediate_size, spec.moe.num_experts
    block, (gate, up, down) = (("block_sparse_moe", ("w1", "w3", "w2")) if spec.arch == "mixtral"
                               else ("mlp", ("gate_proj", "up_proj", "down_proj")))
    shapes: dict[str, tuple[int, ...]] = {f"{p}{block}.gate.weight": (n, d)}
    for e in range(n):
        shapes[f"{p}{block}.experts.{e}.{gate}.weight"] = (inter, d)
        shapes[f"{p}{block}.experts.{e}.{up}.weight"] = (inter, d)
        shapes[f"{p}{block}.experts.{e}.{down}.weight"] = (d, inter)
    return shapes


def _init_mean_std(name: str, shape: tuple[int, ...], spec: ModelSpec) -> tuple[float, float]:
    if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
        return 1.0, NORM_NOISE_STD
    if name.endswith(".bias"):
        return 0.0, BIAS_STD
    if "embed_tokens" in name or name.startswith("lm_head"):
        return 0.0, LOGIT_STD / math.sqrt(spec.hidden_size)
    fan_in = shape[1]
    if "o_proj" in name:
        return 0.0, BLOCK_OUT_RMS / math.sqrt(fan_in)
    if "down_proj" in name or name.endswith(".w2.weight"):
        return 0.0, BLOCK_OUT_RMS / (_SILU_GLU_RMS * math.sqrt(fan_in))
    return 0.0, 1.0 / math.sqrt(fan_in)  # q/k/v/gate/up: unit-RMS outputs from a normalised input


def _tensor_seed(seed: int, name: str) -> int:
    # One stream per tensor: a tensor's values do not depend on which other tensors exist.
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def _uniform(shape: tuple[int, ...], mean: float, std: float, seed: int) -> torch.Tensor:
    """Uniform noise with the given mean/std, bit-identical on every machine.

    Built from integer draws and exactly-rounded float64 arithmetic rather than randn, whose
    vectorised CPU kernels may differ in the last bit between instruction sets.
    """
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    bits = torch.randint(0, 1 << 24, shape, generator=gen, dtype=torch.int64)
    unit = (bits.to(torch.float64) + 0.5) * (2.0 / (1 << 24)) - 1.0  # uniform in (-1, 1), std 1/sqrt(3)
    return (unit * (std * math.sqrt(3.0)) + mean).to(torch.float32)


def _token_scales(vocab_size: int, seed: int, draw: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """Per-row norm factors for the output matrix, with mean square 1."""
    import torch

    draw = draw or _uniform
    # z = sum of four uniforms (Irwin-Hall): near-normal, and bit-reproducible like _uniform.
    z = sum(draw((vocab_size,), 0.0, 0.5, _tensor_seed(seed, f"token_scale.{i}")) for i in range(4))
    scales = torch.exp(TOKEN_NORM_SPREAD * z.to(torch.float64))
    # E[exp(2 t z)] for that z in closed form: each uniform is on [-a, a] with a = sqrt(3) / 2.
    ta = 2 * TOKEN_NORM_SPREAD * math.sqrt(3) / 2
    mean_square = (math.sinh(ta) / ta) ** 4 if ta else 1.0
    return (scales / math.sqrt(mean_square)).to(torch.float32)


def _signs(n: int, seed: int) -> torch.Tensor:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float32) * 2 - 1


def _device_uniform(shape: tuple[int, ...], mean: float, std: float, seed: int, device: torch.device) -> torch.Tensor:
    """Uniform noise with the given mean/std from torch's generator on `device` (init=device)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    unit = torch.rand(shape, generator=gen, device=device, dtype=torch.float32) * 2 - 1
    return unit * (std * math.sqrt(3.0)) + mean


def default_init_device() -> torch.device:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def random_weights(spec: ModelSpec, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """CPU tensors of the spec's dtype. init=device draws them on `device` (default: CUDA where
    there is one) and moves each to the host as it is made, so the device holds one at a time."""
    import torch

    spec = spec.resolved()
    dtype = getattr(torch, spec.dtype)
    if spec.init == "device":
        where = device or default_init_device()
        draw = lambda shape, mean, std, seed: _device_uniform(shape, mean, std, seed, where)  # noqa: E731
    else:
        draw = _uniform
    output_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    weights = {}
    for name, shape in weight_shapes(spec).items():
        mean, std = _init_mean_std(name, shape, spec)
        tensor = draw(shape, mean, std, _tensor_seed(spec.seed, name))
        if name == output_name:
            tensor = tensor * _token_scales(spec.vocab_size, spec.seed, draw).to(tensor.device)[:, None]
        if name == "model.norm.weight":
            tensor = tensor * _signs(spec.hidden_size, _tensor_seed(spec.seed, "final_norm_sign")).to(tensor.device)
        weights[name] = tensor.to(dtype).cpu()
    return weights


def recipe() -> dict[str, Any]:
    # Everything besides the spec that decides a built model's bytes; part of the cache key,
    # so tuning a scale cannot leave stale models in the cache.
    return {
        "builder_version": BUILDER_VERSION,
        "scales": [LOGIT_STD, BLOCK_OUT_RMS, _SILU_GLU_RMS, TOKEN_NORM_SPREAD, NORM_NOISE_STD, BIAS_STD],
    }
