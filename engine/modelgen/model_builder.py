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
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.engine.modelgen.model_spec import (  # noqa: F401  (re-exported: the builder's public names)
    ARCHITECTURES,
    BUILDER_ARCHITECTURES,
    BUILDER_VERSION,
    PRESETS,
    REQUIRED_FILES,
    ModelSpec,
    default_init_device,
    random_weights,
    recipe,
    weight_shapes,
)
from tandem.engine.modelgen.tokenizer_builder import (
    SpecialIds,
    cached_tokenizer,
    family_for_arch,
    save_hf_tokenizer,
)

# The provenance a built model carries: its spec and builder version (random weights, made here).
SPEC_FILE = "tandem_spec.json"

if TYPE_CHECKING:
    import torch


def _rope_parameters(spec: ModelSpec) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_type": "default"}
    params.update(spec.rope_scaling or {})
    params["rope_theta"] = spec.rope_theta
    return params


def write_configs(spec: ModelSpec, ids: SpecialIds, out_dir: Path) -> None:
    """Write config.json and generation_config.json through the transformers config classes."""
    from transformers import GenerationConfig, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    config_cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig,
                  "mixtral": MixtralConfig}[spec.arch]
    config = config_cls(
        architectures=[BUILDER_ARCHITECTURES[spec.arch]],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        **_expert_config(spec),
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


def _expert_config(spec: ModelSpec) -> dict[str, Any]:
    """config.json's experts, under each architecture's names."""
    moe = spec.moe
    if moe is None:
        return {}
    if spec.arch == "mixtral":  # its intermediate_size is the experts' (the spec's is checked equal)
        if moe.intermediate_size != spec.intermediate_size:
            raise ValueError("a mixtral spec's intermediate_size is its experts'")
        return {"num_local_experts": moe.num_experts, "num_experts_per_tok": moe.top_k}
    return {"num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
            "moe_intermediate_size": moe.intermediate_size, "norm_topk_prob": moe.norm_topk_prob,
            "decoder_sparse_step": moe.decoder_sparse_step, "mlp_only_layers": list(moe.mlp_only_layers)}


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



def spec_hash(spec: ModelSpec) -> str:
    fields = dataclasses.asdict(spec.resolved())
    if fields["init"] == "portable":  # the default is left out: models built before `init` existed stay cached
        del fields["init"]
    if fields["moe"] is None:  # likewise for dense models, built before `moe` existed
        del fields["moe"]
    payload = json.dumps([recipe(), fields], sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:10]


def is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in REQUIRED_FILES)


def _write_model_dir(spec: ModelSpec, out_dir: Path, cache_dir: Path, device: torch.device | None) -> None:
    from safetensors.torch import save_file

    family = family_for_arch(spec.arch)
    tok = cached_tokenizer(family, spec.vocab_size, cache_dir)
    ids = save_hf_tokenizer(tok, family, out_dir, spec.max_position_embeddings)
    write_configs(spec, ids, out_dir)
    where = (device or default_init_device()) if spec.init == "device" else None
    save_file(random_weights(spec, where), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    provenance: dict[str, Any] = {"recipe": recipe(), "spec": dataclasses.asdict(spec)}
    if where is not None:  # init=device weights are reproducible on this kind of device only
        provenance["init_device"] = where.type
    (out_dir / SPEC_FILE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")


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
    spec: ModelSpec, out_dir: str | Path, *, cache_dir: Path | None = None, overwrite: bool = False,
    device: torch.device | None = None,
) -> Path:
    """Write a complete HF model directory for `spec` to `out_dir` atomically; returns its path.

    Raises FileExistsError if `out_dir` is a non-empty directory and `overwrite` is false.
    The trained tokenizer is cached under `cache_dir` (default: `tandem_home()`). `device`: where
    an init=device spec draws its weights (default: CUDA where there is one).
    """
    spec = spec.resolved()
    out = Path(out_dir).expanduser().absolute()
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} already exists and is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the published dir should not be
        _write_model_dir(spec, tmp, cache_dir or tandem_home(), device)
        _publish(tmp, out, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # only still there if something failed
    return out
