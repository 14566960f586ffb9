"""Import a GGUF checkpoint once into an HF model directory in the model cache.

Workers load HF directories (config.json, safetensors, tokenizer.json) on their fast path;
a GGUF file is converted to one the first time it is named and reused after that. The cache
key is the file's SHA-256 (plus the importer's version), so a renamed copy is not converted
again, and an edited file is; the directory appears by one rename, so one that exists is
whole, and a file lock keeps two workers started together from converting the same file twice.

transformers does the reading (its GGUF support, through the `gguf` package): the metadata
becomes the config and the tokenizer (chat template included), and quantized tensors
(Q4_0, Q4_1, Q8_0, K-quants, ...) are dequantized. They are stored as float32, which holds
every dequantized value exactly, and cast to the serving dtype (`--dtype`) when a worker loads
them; a quantized file therefore serves at full width, with its quantization's accuracy but
not its memory saving.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tandem.engine.modelgen.model_spec import ARCHITECTURES

log = logging.getLogger(__name__)

IMPORTER_VERSION = 1
PROVENANCE = "tandem_import.json"
# GGUF metadata keys whose ids end a turn besides the tokenizer's EOS (Llama 3's <|eot_id|>, ...).
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


class GGUFError(ValueError):
    """The file is not a GGUF checkpoint this importer can read."""


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def find_gguf(path: Path) -> Path | None:
    """The GGUF that `path` names: the file itself, or the one .gguf in a directory without
    config.json. None when `path` is not about GGUF at all."""
    if path.is_file():
        return path if path.suffix.lower() == ".gguf" else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(p.name for p in found)
        raise GGUFError(f"{path} holds several GGUF files ({names}); name one of them")
    return found[0] if found else None


def cache_dir_for(gguf: Path, digest: str, home: Path) -> Path:
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", gguf.stem)[:80]
    return home / "models" / f"{stem}-{digest[:12]}-gguf{IMPORTER_VERSION}"


def is_imported(model_dir: Path) -> bool:
    return (model_dir / PROVENANCE).is_file()


def import_gguf(gguf: Path, *, home: Path, digest: str | None = None) -> Path:
    """The HF directory for `gguf`, converted now unless the cache already has it."""
    gguf = gguf.expanduser().absolute()
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such file")
    digest = digest or file_sha256(gguf)
    target = cache_dir_for(gguf, digest, home)
    if (done := _imported_copy(target, digest)) is not None:
        return done
    target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target.with_name(f".{target.name}.lock")):
        if is_imported(target):  # another process converted it while we waited
            return target
        if target.exists():  # a leftover without provenance is not ours to trust
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            tmp.chmod(0o755)
            with _parsed_once():
                _convert(gguf, digest, tmp)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _imported_copy(target: Path, digest: str) -> Path | None:
    """`target` if imported, else the directory these bytes were imported to under another file name."""
    if is_imported(target):
        return target
    for other in sorted(target.parent.glob(f"*-{digest[:12]}-gguf{IMPORTER_VERSION}")):
        if is_imported(other) and json.loads((other / PROVENANCE).read_text()).get("sha256") == digest:
            return other
    return None


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextmanager
def _parsed_once() -> Iterator[None]:
    """transformers opens the file three times (config, tokenizer, weights) and builds gguf's
    tensor-name map once per module; parsing 49k tokens and merges costs seconds each time.
    While converting, the same path gets the same reader and the name map is memoized: the
    import takes a third of the time. Both are looked up on the `gguf` module at call time."""
    import gguf as gguf_lib

    real_reader, real_map = gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: Any, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = reader, functools.lru_cache(maxsize=None)(real_map)
    try:
        yield
    finally:
        gguf_lib.GGUFReader, gguf_lib.get_tensor_name_map = real_reader, real_map


def read_header(gguf: Path) -> tuple[dict[str, Any], Counter[str]]:
    """The scalar metadata and the count of tensors per storage type; GGUFError if unreadable."""
    import gguf as gguf_lib

    try:
        reader = gguf_lib.GGUFReader(str(gguf))
        meta = {k: f.contents() for k, f in reader.fields.items() if len(f.data) <= 1}
        types = Counter(t.tensor_type.name for t in reader.tensors)
    except Exception as exc:  # the reader raises anything from ValueError to struct.error on a bad file
        raise GGUFError(f"{gguf.name} is not a readable GGUF file ({type(exc).__name__}: {exc})") from None
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{gguf.name}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    return meta, types


def _convert(gguf: Path, digest: str, out: Path) -> None:
    import torch
    from huggingface_hub import save_torch_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta, types = read_header(gguf)
    quantized = {k: n for k, n in types.items() if k not in ("F32", "F16", "BF16")}
    log.info("importing %s (%s) into %s: %s", gguf.name, meta["general.architecture"], out.parent,
             _describe(types, quantized))
    src, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.architectures = [ARCHITECTURES[meta["general.architecture"]]]
    # transformers reads no head_dim for qwen2/qwen3 files, and Qwen3Config's default (128) is
    # wrong for any other shape; llama.cpp's reading is attention.key_length, else hidden / heads.
    key_length = meta.get(f"{meta['general.architecture']}.attention.key_length")
    config.head_dim = int(key_length or config.hidden_size // config.num_attention_heads)
    with torch.device("meta"):  # only for the tensor-name map: no memory
        skeleton = AutoModelForCausalLM.from_config(config)
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    expected = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise GGUFError(f"{gguf.name} lacks tensors the model needs: {missing[:4]}")
    misshapen = [f"{n} {tuple(t.shape)} != {expected[n]}" for n, t in tensors.items()
                 if n in expected and tuple(t.shape) != expected[n]]
    if misshapen:
        raise GGUFError(f"{gguf.name}: tensor shapes disagree with its metadata: {misshapen[:3]}")
    state = {k: v.to(torch.float32).contiguous() for k, v in tensors.items() if k in expected}
    save_torch_state_dict(state, str(out), max_shard_size="2GB")
    config.save_pretrained(str(out))
    _add_legacy_keys(out / "config.json")
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(str(out))
    _portable_tokenizer_config(out / "tokenizer_config.json", config.max_position_embeddings)
    _write_generation_config(config, meta, out)
    provenance = {"importer_version": IMPORTER_VERSION, "source": str(gguf), "sha256": digest,
                  "architecture": meta["general.architecture"], "tensor_types": dict(types),
                  "stored_dtype": "float32", "dequantized": bool(quantized)}
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # the shard writer makes private files; the cache is read by other users' pods too


def _describe(types: Counter[str], quantized: dict[str, int]) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in types.most_common())
    if not quantized:
        return f"tensors {counts}, stored as float32"
    return (f"tensors {counts}; the quantized ones are dequantized to float32 here and cast to the serving "
            "dtype at load (full-width weights: the quantization's accuracy, not its memory saving)")


def _add_legacy_keys(path: Path) -> None:
    # transformers v5 writes rope_parameters/dtype; v4 and other engines (vLLM) read rope_theta/torch_dtype.
    cfg = json.loads(path.read_text())
    rope = cfg.get("rope_parameters") or {}
    cfg["torch_dtype"] = "float32"
    cfg.setdefault("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", "default") != "default":
        cfg.setdefault("rope_scaling", {k: v for k, v in rope.items() if k != "rope_theta"})
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _portable_tokenizer_config(path: Path, max_positions: int) -> None:
    # transformers v5 names its own backend class and this machine's load flags; v4 and other
    # engines (vLLM, the router's `tokenizers` + jinja2) know the fast tokenizer by its old name.
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = max_positions
    for key in ("is_local", "local_files_only", "backend"):
        cfg.pop(key, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_generation_config(config: Any, meta: dict[str, Any], out: Path) -> None:
    """Every id that ends a turn: the tokenizer's EOS and the end-of-turn ids GGUF names."""
    from transformers import GenerationConfig

    eos = [meta.get("tokenizer.ggml.eos_token_id")] + [meta.get(k) for k in _EXTRA_EOS_KEYS]
    ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    gen = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=ids if len(ids) != 1 else ids[0],
                           pad_token_id=meta.get("tokenizer.ggml.padding_token_id"))
    gen.save_pretrained(str(out))
