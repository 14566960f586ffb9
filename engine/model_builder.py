"""Build complete HF-format model directories locally, with no downloads.

Data flow: ModelSpec -> (config.json, generation_config.json) via transformers config
classes; deterministic random weights -> model.safetensors; cached trained BPE tokenizer
(tokenizer_builder) -> tokenizer.json + tokenizer_config.json. Everything is written into
a temp dir next to the target and renamed into place, so a directory that exists is whole.

The random weights are scaled so the model's next-token distribution is peaked (logit std
around 4.5, wide top-1/top-2 gaps), so greedy decoding by two implementations agrees token for token.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.engine.tokenizer_builder import (
    SpecialIds,
    cached_tokenizer,
    family_for_arch,
    save_hf_tokenizer,
)

if TYPE_CHECKING:
    import torch

# Bump when the weight recipe or file layout changes; it is part of every cache key.
BUILDER_VERSION = 2

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
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

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {self.arch!r}")
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
        if spec.arch == "qwen3":
            shapes[p + "self_attn.q_norm.weight"] = (hd,)
            shapes[p + "self_attn.k_norm.weight"] = (hd,)
        shapes[p + "self_attn.o_proj.weight"] = (d, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (d,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, d)
        shapes[p + "mlp.up_proj.weight"] = (inter, d)
        shapes[p + "mlp.down_proj.weight"] = (d, inter)
    shapes["model.norm.weight"] = (d,)
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, d)
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
    if "down_proj" in name:
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


def _token_scales(vocab_size: int, seed: int) -> torch.Tensor:
    """Per-row norm factors for the output matrix, with mean square 1."""
    import torch

    # z = sum of four uniforms (Irwin-Hall): near-normal, and bit-reproducible like _uniform.
    z = sum(_uniform((vocab_size,), 0.0, 0.5, _tensor_seed(seed, f"token_scale.{i}")) for i in range(4))
    scales = torch.exp(TOKEN_NORM_SPREAD * z.to(torch.float64))
    # E[exp(2 t z)] for that z in closed form: each uniform is on [-a, a] with a = sqrt(3) / 2.
    ta = 2 * TOKEN_NORM_SPREAD * math.sqrt(3) / 2
    mean_square = (math.sinh(ta) / ta) ** 4 if ta else 1.0
    return (scales / math.sqrt(mean_square)).to(torch.float32)


def _signs(n: int, seed: int) -> torch.Tensor:
    import torch

    gen = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float32) * 2 - 1


def random_weights(spec: ModelSpec) -> dict[str, torch.Tensor]:
    import torch

    spec = spec.resolved()
    dtype = getattr(torch, spec.dtype)
    output_name = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
    weights = {}
    for name, shape in weight_shapes(spec).items():
        mean, std = _init_mean_std(name, shape, spec)
        tensor = _uniform(shape, mean, std, _tensor_seed(spec.seed, name))
        if name == output_name:
            tensor = tensor * _token_scales(spec.vocab_size, spec.seed)[:, None]  # (vocab, hidden)
        if name == "model.norm.weight":
            tensor = tensor * _signs(spec.hidden_size, _tensor_seed(spec.seed, "final_norm_sign"))
        weights[name] = tensor.to(dtype)
    return weights


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default"}
    params.update(spec.rope_scaling or {})
    params["rope_theta"] = spec.rope_theta
    return params


def write_configs(spec: ModelSpec, ids: SpecialIds, out_dir: Path) -> None:
    """Write config.json and generation_config.json through the transformers config classes."""
    from transformers import GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[spec.arch]
    config = config_cls(
        architectures=[ARCHITECTURES[spec.arch]],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rms_norm_eps=spec.rms_norm_eps,
        rope_parameters=_rope_parameters(spec),
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=ids.bos,
        eos_token_id=ids.eos,
        dtype=spec.dtype,
    )
    config.save_pretrained(str(out_dir))
    _add_legacy_config_keys(out_dir / "config.json", spec)
    gen = GenerationConfig(bos_token_id=ids.bos, eos_token_id=list(ids.eos_all), pad_token_id=ids.pad)
    gen.save_pretrained(str(out_dir))


def _add_legacy_config_keys(path: Path, spec: ModelSpec) -> None:
    # transformers v5 writes rope_parameters/dtype; v4 and most serving engines read
    # rope_theta/rope_scaling/torch_dtype. Both spellings carry the same values.
    cfg = json.loads(path.read_text())
    cfg["torch_dtype"] = spec.dtype
    cfg["rope_theta"] = spec.rope_theta
    cfg["rope_scaling"] = dict(spec.rope_scaling) if spec.rope_scaling else None
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def tandem_home() -> Path:
    return Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()


def _recipe() -> dict[str, Any]:
    # Everything besides the spec that decides a built model's bytes; part of the cache key,
    # so tuning a scale cannot leave stale models in the cache.
    return {
        "builder_version": BUILDER_VERSION,
        "scales": [LOGIT_STD, BLOCK_OUT_RMS, _SILU_GLU_RMS, TOKEN_NORM_SPREAD, NORM_NOISE_STD, BIAS_STD],
    }


def spec_hash(spec: ModelSpec) -> str:
    payload = json.dumps([_recipe(), dataclasses.asdict(spec.resolved())], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _write_model_dir(spec: ModelSpec, out_dir: Path, cache_dir: Path) -> None:
    from safetensors.torch import save_file

    family = family_for_arch(spec.arch)
    tok = cached_tokenizer(family, spec.vocab_size, cache_dir)
    ids = save_hf_tokenizer(tok, family, out_dir, spec.max_position_embeddings)
    write_configs(spec, ids, out_dir)
    save_file(random_weights(spec), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    provenance = {"recipe": _recipe(), "spec": dataclasses.asdict(spec)}
    (out_dir / "tandem_spec.json").write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")


def _publish(tmp: Path, out: Path, overwrite: bool) -> None:
    if overwrite and out.exists():
        trash = out.with_name(f".{out.name}.old-{os.getpid()}")
        os.rename(out, trash)
        os.rename(tmp, out)
        shutil.rmtree(trash, ignore_errors=True)
        return
    try:
        os.rename(tmp, out)  # succeeds onto a missing or empty dir; fails if another builder won
    except OSError as exc:
        raise FileExistsError(f"{out} already exists and is not empty") from exc


def build_model(
    spec: ModelSpec, out_dir: str | Path, *, cache_dir: Path | None = None, overwrite: bool = False
) -> Path:
    """Write a complete HF model directory for `spec` to `out_dir` atomically; returns its path.

    Raises FileExistsError if `out_dir` is a non-empty directory and `overwrite` is false.
    The trained tokenizer is cached under `cache_dir` (default: `tandem_home()`).
    """
    spec = spec.resolved()
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the published dir should not be
        _write_model_dir(spec, tmp, cache_dir or tandem_home())
        _publish(tmp, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only still there if something failed
    return out


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None) -> Path:
    """An existing directory as is; a preset name built once into `<cache>/models/<name>-<hash>`."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path not in PRESETS:
        raise ValueError(f"{name_or_path!r} is neither a directory nor a preset ({', '.join(PRESETS)})")
    spec = PRESETS[name_or_path]
    home = cache_dir or tandem_home()
    target = home / "models" / f"{name_or_path}-{spec_hash(spec)}"
    if is_complete(target):
        return target
    try:
        # A leftover incomplete dir (e.g. a hand-edited cache) is rebuilt in place.
        build_model(spec, target, cache_dir=home, overwrite=target.exists())
    except FileExistsError:
        if not is_complete(target):  # lost the race to a builder whose result is unusable
            raise
    return target
