"""Load HF checkpoints (ours or real Qwen/Llama/Mixtral ones) into the native model.

HF stores q/k/v and gate/up as separate tensors; the native model fuses them,
so each checkpoint tensor is copied into a row range of a fused parameter (under tensor
parallelism, of this rank's share: the sizes below are then the rank's, parallel/shard.py):

    qkv_proj rows:     [0, q_size) q | [q_size, q_size+kv_size) k | [.., +kv_size) v
    gate_up_proj rows: [0, inter) gate | [inter, 2*inter) up

An MoE layer's experts are stacked: each checkpoint expert tensor is copied into its expert's
slice of `mlp.gate_up` ([gate; up] rows, as above) or `mlp.down` (models/moe.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.engine.kvcache.kv_scales import KVScales, kv_scale_weight
from tandem.engine.model_config import ModelConfig
from tandem.engine.models.llama import LlamaForCausalLM
from tandem.engine.models.moe import expert_weight, router_weight, stacked_experts
from tandem.engine.parallel.group import SINGLE, TPGroup

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
}

# checkpoint suffix -> (fused native suffix, shard index)
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _checkpoint_tensors(path: Path) -> Iterator[tuple[str, Any]]:
    """(name, lazy slice) of every tensor: reading one (`[...]`, `[a:b]`, `[:, a:b]`) loads
    only those rows or columns, so a tensor-parallel rank never holds a whole checkpoint."""
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else None
    if files is None:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    for name in files:
        with safe_open(str(path / name), framework="pt") as f:
            for key in f.keys():
                yield key, f.get_slice(key)


# Checkpoint module -> (the dimension TP splits, which of the rank's ranges: TPShard.features).
# Column-parallel layers split their output rows (dim 0, biases too); row-parallel ones
# (o, down) their input columns (dim 1).
_SPLIT = {
    "self_attn.q_proj": (0, "q"), "self_attn.k_proj": (0, "kv"), "self_attn.v_proj": (0, "kv"),
    "mlp.gate_proj": (0, "mlp"), "mlp.up_proj": (0, "mlp"),
    "self_attn.o_proj": (1, "q"), "mlp.down_proj": (1, "mlp"),
}


def _read(cfg: ModelConfig, name: str, tensor: Any) -> torch.Tensor:
    """The part of checkpoint tensor `name` this rank holds (all of it without TP)."""
    s = cfg.shard
    if s is None:
        return tensor[:]
    if name in ("embed_tokens.weight", "lm_head.weight"):  # vocabulary rows; past the end: zeros
        lo, hi = s.vocab
        part = tensor[lo: min(hi, s.vocab_size)]
        return torch.nn.functional.pad(part, (0, 0, 0, hi - lo - part.shape[0]))
    prefix = name.rpartition(".")[0]
    for module, (dim, part) in _SPLIT.items():
        if prefix.endswith(module):
            lo, hi = s.features(part, cfg.head_dim)
            return tensor[lo:hi] if dim == 0 else tensor[:, lo:hi]
    return tensor[:]  # norms: every rank holds them whole


def _shard_rows(cfg: ModelConfig, fused: str, shard: int) -> tuple[int, int]:
    if fused.endswith("qkv_proj"):
        sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
    else:
        sizes = [cfg.intermediate_size] * 2
    start = sum(sizes[:shard])
    return start, start + sizes[shard]


def load_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_positions: int,
               tp: TPGroup = SINGLE) -> nn.Module:
    """The model, or with `cfg` a rank's view (ModelConfig.for_rank) this rank's shard of it."""
    cls = MODEL_REGISTRY[cfg.architecture]
    with torch.device("meta"):
        model = cls(cfg, max_positions, tp)
    _materialize(model)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    local = {e: i for i, e in enumerate(cfg.local_experts)}  # expert parallelism: the experts held here
    kv_scales: dict[tuple[int, str], float] = {}
    for key, tensor in _checkpoint_tensors(Path(cfg.path)):
        name = key.removeprefix("model.")
        if "rotary_emb" in name or (name == "lm_head.weight" and cfg.tie_word_embeddings):
            continue
        scale = kv_scale_weight(name)
        if scale is not None:  # an fp8 KV cache's calibration: the pool takes it (kvcache/kv_scales.py)
            kv_scales[scale] = _scalar(key, tensor)
            continue
        expert = expert_weight(name)
        if expert is not None:  # one expert's gate, up or down: a slice of the stacked parameter
            target, e, part = expert
            if e in local:  # another rank's expert otherwise
                _load_expert(cfg, params[target].data[local[e]], part, tensor)
                loaded.add(f"{target}#{local[e]}.{part}")
            continue
        stacked = stacked_experts(name)
        if stacked is not None:  # every expert of the layer in one tensor: each held one's slice
            target, gate_up = stacked
            for e, i in local.items():
                for part in ((0, 1) if gate_up else (2,)):
                    _load_expert(cfg, params[target].data[i], part, _ExpertSlice(tensor, e, part))
                    loaded.add(f"{target}#{i}.{part}")
            continue
        name = router_weight(name) or name
        layer_prefix, _, suffix = name.rpartition(".")  # e.g. layers.0.self_attn.q_proj / weight
        for src, (dst, shard) in _FUSED.items():
            if layer_prefix.endswith(src):
                target = f"{layer_prefix[: -len(src)]}{dst}.{suffix}"
                lo, hi = _shard_rows(cfg, dst, shard)
                params[target].data[lo:hi].copy_(_read(cfg, name, tensor))
                loaded.add(f"{target}#{shard}")
                break
        else:
            if name not in params:
                raise KeyError(f"checkpoint tensor {key!r} has no place in {cls.__name__}")
            params[name].data.copy_(_read(cfg, name, tensor))
            loaded.add(name)
    _check_complete(params, loaded)
    # to_empty() wiped the RoPE tables along with the parameters; rebuild them.
    model.rope.__init__(cfg.hf_config, cfg.head_dim, max_positions)
    model = model.to(device=device, dtype=dtype).eval()
    model.kv_scales = KVScales.from_checkpoint(kv_scales, cfg.num_layers)
    return model


def _materialize(model: nn.Module) -> None:
    """What `to_empty(device="cpu")` does, without passing the meta tensors through
    `empty_like`: on the meta device that runs torch's Python refs, which import sympy, about
    a second of every worker's start. A tensor shared between modules stays shared."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for slots, wrap in ((module._parameters, True), (module._buffers, False)):
            for name, t in slots.items():
                if t is None:
                    continue
                if id(t) not in made:
                    e = torch.empty(t.shape, dtype=t.dtype)
                    made[id(t)] = nn.Parameter(e, requires_grad=t.requires_grad) if wrap else e
                slots[name] = made[id(t)]


def _scalar(key: str, tensor: Any) -> float:
    """A per-tensor scale: one number, stored as shape () or (1,)."""
    shape = list(tensor.get_shape())
    if shape not in ([], [1]):
        raise ValueError(f"checkpoint tensor {key!r} has shape {shape}: a per-tensor KV scale is one number "
                         "(per-head or per-channel KV scales are not supported)")
    return float(tensor[...].float().reshape(()))


class _ExpertSlice:
    """One expert's gate, up or down matrix inside a stacked (E, 2I, H) or (E, H, I) tensor, read
    lazily like a checkpoint tensor: `[lo:hi]` rows of gate or up, `[:, lo:hi]` columns of down."""

    def __init__(self, tensor: Any, expert: int, part: int) -> None:
        self.tensor, self.expert, self.part = tensor, expert, part
        self.offset = tensor.get_shape()[1] // 2 if part == 1 else 0  # up rows follow the gate's

    def __getitem__(self, key: Any) -> torch.Tensor:
        e = slice(self.expert, self.expert + 1)
        if isinstance(key, slice):
            key = slice((key.start or 0) + self.offset, (key.stop if key.stop is not None
                                                         else self.tensor.get_shape()[1] // 2) + self.offset)
            return self.tensor[e, key][0]
        return self.tensor[(e, *key)][0]


def _load_expert(cfg: ModelConfig, dst: torch.Tensor, part: int, tensor: Any) -> None:
    """Expert `dst` ([gate; up] rows, or down) takes its gate, up or down tensor; under TP this
    rank's intermediate features of it: gate/up rows, down columns."""
    inter = cfg.moe_intermediate_size
    lo, hi = cfg.shard.features("moe", cfg.head_dim) if cfg.shard is not None else (0, inter)
    if part == 2:
        dst.copy_(tensor[:, lo:hi])
    else:
        dst[part * inter : (part + 1) * inter].copy_(tensor[lo:hi])


def _check_complete(params: dict[str, nn.Parameter], loaded: set[str]) -> None:
    missing = []
    for name in params:
        if name.endswith("mlp.gate_up") or name.endswith("mlp.down"):  # stacked experts
            parts = (0, 1) if name.endswith("gate_up") else (2,)
            need = [f"{name}#{e}.{p}" for e in range(params[name].shape[0]) for p in parts]
        elif name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            need = [f"{name}#{i}" for i in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            need = [f"{name}#{i}" for i in range(2)]
        else:
            need = [name]
        missing += [n for n in need if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing tensors: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
