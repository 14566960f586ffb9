"""The `*-shape` presets the GPU benchmark times (bench/gpu_decode.py): Llama-3.2-1B's and
Llama-3.1-8B's shapes with random weights drawn on the build's device (init=device).

The 8B model (16 GB) is built on the GPU only; here its spec is checked against Llama-3.1-8B's
config, its name is resolved to the cache directory it would be built in, and the same build
path runs on CPU at a scaled-down size (the real head_dim and GQA ratio, few layers, a small
vocabulary).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tandem.engine.modelgen import resolve  # noqa: E402
from tandem.engine.modelgen.model_builder import PRESETS, ModelSpec, build_model, spec_hash  # noqa: E402
from tandem.engine.modelgen.model_spec import weight_shapes  # noqa: E402

# Llama-3.1-8B's config.json, the fields a decode step's cost depends on.
LLAMA_8B = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "intermediate_size": 14336, "vocab_size": 128256, "tie_word_embeddings": False}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def scaled_down() -> ModelSpec:
    """llama-8b-shape with its head_dim, GQA ratio, dtype and init, at a size a CPU builds in seconds."""
    return dataclasses.replace(PRESETS["llama-8b-shape"], hidden_size=256, num_layers=2, num_heads=4,
                               num_kv_heads=1, intermediate_size=512, vocab_size=2048)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_llama_8b_shape_is_llama_3_1_8b() -> None:
    spec = PRESETS["llama-8b-shape"].resolved()
    got = {"hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
           "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads,
           "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size,
           "vocab_size": spec.vocab_size, "tie_word_embeddings": spec.tie_word_embeddings}
    assert got == LLAMA_8B
    assert (spec.arch, spec.dtype, spec.init) == ("llama", "bfloat16", "device")
    assert 8.0e9 < spec.param_count() < 8.1e9  # Llama-3.1-8B: 8.03B
    assert PRESETS["llama-1b-shape"].init == "device" and PRESETS["tiny"].init == "portable"


def test_the_name_resolves_to_its_cache_directory(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """resolve_model builds a preset once into models/<name>-<hash>; the build itself is stubbed
    (16 GB), the path and the spec it is handed are what is checked."""
    built = []

    def fake_build(spec, target, *, cache_dir, overwrite):
        built.append((spec, target))
        target.mkdir(parents=True)
        for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"):
            (target / name).write_text("{}")
        return target

    monkeypatch.setattr(resolve, "build_model", fake_build)
    path = resolve.resolve_model("llama-8b-shape")
    assert path == home / "models" / f"llama-8b-shape-{spec_hash(PRESETS['llama-8b-shape'])}"
    assert built == [(PRESETS["llama-8b-shape"], path)]
    assert resolve.resolve_model("llama-8b-shape") == path and len(built) == 1  # cached


def test_portable_presets_keep_their_cache_names() -> None:
    """`init` is left out of the hash at its default, so models cached before it existed are found."""
    tiny = PRESETS["tiny"]
    assert spec_hash(tiny) == "0e931f5f74"
    assert spec_hash(dataclasses.replace(tiny, init="device")) != spec_hash(tiny)


def test_scaled_down_8b_builds_on_the_device_and_loads_in_hf(home: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    spec = scaled_down()
    a = build_model(spec, tmp_path / "a", device=torch.device("cpu"))
    b = build_model(spec, tmp_path / "b", device=torch.device("cpu"))
    assert sha256(a / "model.safetensors") == sha256(b / "model.safetensors")  # one device, one seed: same bytes
    portable = build_model(dataclasses.replace(spec, init="portable"), tmp_path / "p")
    assert sha256(a / "model.safetensors") != sha256(portable / "model.safetensors")
    assert json.loads((a / "tandem_spec.json").read_text())["init_device"] == "cpu"

    model = AutoModelForCausalLM.from_pretrained(str(a)).eval()
    cfg = model.config
    gqa = cfg.num_attention_heads // cfg.num_key_value_heads
    assert (cfg.head_dim, gqa, cfg.tie_word_embeddings) == (128, 4, False)
    params = dict(model.named_parameters())
    assert {k: tuple(v.shape) for k, v in params.items()} == weight_shapes(spec)
    assert all(p.dtype == torch.bfloat16 for p in params.values())
    # The same scales as the portable draw: q/k/v/gate/up have std 1/sqrt(fan_in), norms 1 +- 0.1.
    q = params["model.layers.0.self_attn.q_proj.weight"].float()
    assert q.std().item() == pytest.approx(1 / math.sqrt(spec.hidden_size), rel=0.05)
    assert q.abs().max().item() <= math.sqrt(3 / spec.hidden_size) * 1.01  # uniform, not normal
    norm = params["model.layers.0.input_layernorm.weight"].float()
    assert norm.mean().item() == pytest.approx(1.0, abs=0.02) and norm.std().item() == pytest.approx(0.1, rel=0.2)
    with torch.no_grad():
        logits = model(torch.arange(1, 33)[None]).logits[0].float()
    assert torch.isfinite(logits).all() and 3.0 < logits.std(-1).mean().item() < 6.5  # peaked, as the builder intends
