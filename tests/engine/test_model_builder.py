"""`tandem make-model`: built directories load in HF transformers and behave as intended.

Models here are built with small shapes (hidden 64, vocab 512) so tokenizer training and
weight generation take well under a second each; the cache lives in a per-module TANDEM_HOME.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tandem.engine.modelgen.model_builder import (  # noqa: E402
    PRESETS,
    ModelSpec,
    build_model,
    weight_shapes,
)
from tandem.engine.modelgen.resolve import resolve_model  # noqa: E402


def _spec(arch: str, **changes) -> ModelSpec:
    base = ModelSpec(
        arch=arch,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=512,
        # Llama untied so the separate lm_head path is covered; Qwen tied.
        tie_word_embeddings=arch != "llama",
    )
    return dataclasses.replace(base, **changes)


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory):
    """A private TANDEM_HOME for this module, restored afterwards."""
    path = tmp_path_factory.mktemp("tandem_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TANDEM_HOME", str(path))
        yield path


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _load_hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(str(model_dir), output_loading_info=True)
    return model.eval(), info


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_built_model_loads_in_hf(arch: str, home: Path, tmp_path: Path) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    spec = _spec(arch)
    out = build_model(spec, tmp_path / "m")
    cfg = AutoConfig.from_pretrained(str(out))
    expected_arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
    assert cfg.architectures == [expected_arch[arch]]
    assert (cfg.head_dim, cfg.tie_word_embeddings, cfg.vocab_size) == (16, spec.tie_word_embeddings, 512)
    raw = json.loads((out / "config.json").read_text())
    assert raw["torch_dtype"] == "float32" and raw["rope_theta"] == spec.rope_theta

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    assert shapes == weight_shapes(spec)
    assert ("lm_head.weight" in shapes) == (not spec.tie_word_embeddings)
    assert any("q_norm" in n for n in shapes) == (arch == "qwen3")
    assert any(n.endswith("q_proj.bias") for n in shapes) == (arch == "qwen2")

    model, info = _load_hf(out)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    if arch == "qwen2":
        assert model.model.layers[0].self_attn.k_proj.bias.abs().min() > 0
    ids = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    std = logits.std(-1).mean().item()
    assert 3.0 < std < 6.0, std


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tokenizer_matches_config(arch: str, home: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    out = build_model(_spec(arch), tmp_path / "m")
    tok = AutoTokenizer.from_pretrained(str(out))
    cfg = AutoConfig.from_pretrained(str(out))
    gen = json.loads((out / "generation_config.json").read_text())
    assert tok.is_fast and len(tok) == 512
    assert tok.bos_token_id == cfg.bos_token_id == gen["bos_token_id"]
    assert tok.eos_token_id == cfg.eos_token_id == gen["eos_token_id"][0]
    assert len(gen["eos_token_id"]) == 2

    text = "def f(x):\n    return x ** 2  # naïve 世界 🙂\n\ttabs  and  spaces"
    ids = tok.encode(text)
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert (ids[0] == tok.bos_token_id) == (arch == "llama")  # Llama-3 adds BOS, Qwen does not

    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    if arch == "llama":
        assert chat.startswith("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>")
        assert chat.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    else:
        assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    chat_ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    chat_ids = chat_ids["input_ids"] if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys") else chat_ids
    assert tok.eos_token_id in chat_ids  # the end-of-turn token is one special id, not split
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"]


@pytest.mark.parametrize(
    "scaling",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        {"rope_type": "linear", "factor": 2.0},
    ],
)
def test_rope_scaling_variant_loads(scaling: dict, home: Path, tmp_path: Path) -> None:
    spec = _spec("llama", rope_theta=500_000.0, rope_scaling=scaling)
    out = build_model(spec, tmp_path / "m")
    model, info = _load_hf(out)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.rope_parameters["rope_type"] == scaling["rope_type"]
    assert json.loads((out / "config.json").read_text())["rope_scaling"] == scaling
    # The scaling reached HF's rotary embedding: its frequencies differ from unscaled rope.
    base = 1.0 / (500_000.0 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    assert not torch.allclose(model.model.rotary_emb.inv_freq, base)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(40)[None]).logits).all()


def test_same_seed_same_bytes(home: Path, tmp_path: Path) -> None:
    a = build_model(_spec("qwen2"), tmp_path / "a")
    b = build_model(_spec("qwen2"), tmp_path / "b")
    c = build_model(_spec("qwen2", seed=1), tmp_path / "c")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(a / name) == _sha256(b / name), name
    assert _sha256(a / "model.safetensors") != _sha256(c / "model.safetensors")


def test_build_refuses_to_clobber_and_leaves_no_temp(home: Path, tmp_path: Path) -> None:
    out = build_model(_spec("qwen3"), tmp_path / "m")
    before = _sha256(out / "model.safetensors")
    with pytest.raises(FileExistsError):
        build_model(_spec("qwen3", seed=7), out)
    assert _sha256(out / "model.safetensors") == before
    build_model(_spec("qwen3", seed=7), out, overwrite=True)
    assert _sha256(out / "model.safetensors") != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temp or trash dirs left


def test_resolve_model_builds_tiny_once(home: Path) -> None:
    t0 = time.perf_counter()
    first = resolve_model("tiny")
    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    second = resolve_model("tiny")
    again_s = time.perf_counter() - t0
    print(f"tiny: {PRESETS['tiny'].param_count() / 1e6:.2f}M params, built in {build_s:.2f}s")
    assert first == second and first.parent == home / "models" and first.name.startswith("tiny-")
    assert again_s < 0.2
    assert resolve_model(str(first)) == first  # a directory passes through untouched
    with pytest.raises(ValueError):
        resolve_model("no-such-preset")


def test_tiny_is_peaked_and_not_degenerate(home: Path) -> None:
    """The property token-exact comparisons rely on: confident, varied greedy tokens."""
    from transformers import AutoTokenizer

    path = resolve_model("tiny")
    model, _ = _load_hf(path)
    tok = AutoTokenizer.from_pretrained(str(path))
    gaps, distinct = [], []
    for prompt in ("def fibonacci(n):", "import os\nimport sys\n", "The quick brown fox"):
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0)
            logits = model(out).logits[0]
        top2 = logits.topk(2, dim=-1).values
        gaps.append(top2[:, 0] - top2[:, 1])
        distinct.append(len(set(out[0, ids.shape[1] :].tolist())))
        assert 3.0 < logits.std(-1).mean().item() < 6.0
    gap = torch.cat(gaps)
    print(f"tiny: median top-1/top-2 gap {gap.median():.2f}, distinct greedy tokens {distinct} of 64")
    assert gap.median() > 1.0
    assert min(distinct) >= 8


def test_small_preset_size() -> None:
    n = PRESETS["small"].param_count()
    print(f"small: {n / 1e6:.1f}M params")
    assert 140e6 < n < 165e6


def test_spec_validation() -> None:
    with pytest.raises(ValueError):
        _spec("mistral")
    with pytest.raises(ValueError):
        _spec("llama", num_kv_heads=3)
    with pytest.raises(ValueError):
        _spec("llama", rope_scaling={"factor": 2.0})
    assert _spec("llama").resolved().head_dim == 16


def test_cli_make_model(home: Path, tmp_path: Path) -> None:
    from transformers import AutoConfig

    from tandem.cli import main

    out = tmp_path / "cli"
    argv = ["make-model", "--arch", "qwen2", "--out", str(out), "--hidden", "64", "--layers", "2"]
    argv += ["--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "512", "--no-tie"]
    argv += ["--rope-scaling", '{"rope_type": "linear", "factor": 2.0}', "--seed", "3"]
    assert main(argv) == 0
    cfg = AutoConfig.from_pretrained(str(out))
    assert (cfg.model_type, cfg.hidden_size, cfg.num_hidden_layers, cfg.head_dim) == ("qwen2", 64, 2, 16)
    assert cfg.tie_word_embeddings is False and cfg.rope_parameters["factor"] == 2.0
    assert main(argv) == 2  # exists; --force replaces it
    assert main([*argv, "--force"]) == 0
    assert main(["make-model", "--out", str(tmp_path / "x")]) == 2  # neither --arch nor --preset

    preset_out = tmp_path / "preset"
    argv = ["make-model", "--preset", "tiny-llama-rope", "--out", str(preset_out), "--hidden", "64"]
    assert main([*argv, "--intermediate", "128", "--vocab", "512", "--layers", "1"]) == 0
    cfg = AutoConfig.from_pretrained(str(preset_out))
    assert cfg.rope_parameters["rope_type"] == "llama3" and cfg.head_dim == 16  # re-derived: 64 / 4


def test_cli_module_does_not_import_torch() -> None:
    heavy = "{'torch', 'transformers', 'tokenizers'}"
    code = f"import sys, tandem.engine.cli; print(sorted({heavy} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
