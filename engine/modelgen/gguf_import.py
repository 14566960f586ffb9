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

A file is distrusted until checked (gguf_header.py): its header is read within bounds, its
layer count and dimensions checked, and every tensor's shape compared with the shape the
metadata implies, all before the first tensor is dequantized; then tensors are converted and
written one at a time (safetensors_stream.py). Whatever goes wrong with the file is a
GGUFError, one line; a run killed halfway leaves a temp directory that the next import
removes (any whose lock no process holds).
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

from tandem.engine.modelgen import gguf_header
from tandem.engine.modelgen.gguf_header import GGUFError
from tandem.engine.modelgen.safetensors_stream import write_float32

log = logging.getLogger(__name__)

IMPORTER_VERSION = 1
PROVENANCE = "tandem_import.json"
# GGUF metadata keys whose ids end a turn besides the tokenizer's EOS (Llama 3's <|eot_id|>, ...).
_EXTRA_EOS_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")

__all__ = ["GGUFError", "import_gguf", "read_header"]


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
    remove_stale_temp_dirs(target.parent)
    with _locked(_lock_path(target)):
        if is_imported(target):  # another process converted it while we waited
            return target
        if target.exists():  # a leftover without provenance is not ours to trust
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}{_TMP}", dir=target.parent))
        try:
            tmp.chmod(0o755)
            with _parsed_once():
                _convert(gguf, digest, tmp)
            os.rename(tmp, target)
        except (GGUFError, OSError):
            raise
        except Exception as exc:  # transformers and gguf raise anything on a file they cannot make sense of
            raise GGUFError(f"{gguf.name} cannot be converted ({type(exc).__name__}: {str(exc)[:300]})") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


_TMP = ".tmp-"


def _lock_path(target: Path) -> Path:
    return target.with_name(f".{target.name}.lock")


def remove_stale_temp_dirs(models: Path) -> list[Path]:
    """Remove the temp directories of conversions that were killed: a conversion holds its
    target's lock until its temp directory is renamed or removed, so one whose lock can be
    taken now belongs to no live process, on this host or any other sharing the cache."""
    removed = []
    for tmp in sorted(models.glob(f".*-gguf*{_TMP}*")):
        target = models / tmp.name[1:].split(_TMP, 1)[0]
        with open(_lock_path(target), "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a conversion of that file is running
                continue
            try:
                if tmp.exists():
                    shutil.rmtree(tmp, ignore_errors=True)
                    removed.append(tmp)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    if removed:
        log.info("removed %d temp dir(s) of killed GGUF imports: %s", len(removed), ", ".join(p.name for p in removed))
    return removed


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
    """The scalar metadata and the count of tensors per storage type; GGUFError if the file is
    malformed or not a model this importer converts."""
    header = gguf_header.read(gguf)
    gguf_header.check_model(header, gguf.name)
    return header.metadata, header.tensor_types()


def _convert(gguf: Path, digest: str, out: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    header = gguf_header.read(gguf)
    gguf_header.check_model(header, gguf.name)
    meta, types = header.metadata, header.tensor_types()
    arch = header.architecture
    quantized = {k: n for k, n in types.items() if k not in ("F32", "F16", "BF16")}
    log.info("importing %s (%s) into %s: %s", gguf.name, arch, out.parent, _describe(types, quantized))
    src, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    config.architectures = [gguf_header.GGUF_ARCHITECTURES[arch]]
    if arch in gguf_header.MOE_GGUF_ARCHITECTURES:
        # transformers maps the expert count and top-k but not each expert's width; llama.cpp's
        # qwen3moe makes every layer sparse (it has no decoder_sparse_step or mlp_only_layers)
        config.moe_intermediate_size = int(meta[f"{arch}.expert_feed_forward_length"])
        config.decoder_sparse_step, config.mlp_only_layers = 1, []
    # transformers reads no head_dim for qwen2/qwen3 files, and Qwen3Config's default (128) is
    # wrong for any other shape; llama.cpp's reading is attention.key_length, else hidden / heads.
    key_length = meta.get(f"{arch}.attention.key_length")
    config.head_dim = int(key_length or config.hidden_size // config.num_attention_heads)
    with torch.device("meta"):  # shapes and names only: no memory (the layer count is bounded)
        skeleton = AutoModelForCausalLM.from_config(config)
    expected = {n: tuple(p.shape) for n, p in skeleton.named_parameters()}
    plan, process = _tensor_plan(gguf, header, skeleton, expected)
    write_float32(out, [(hf, expected[hf]) for hf in plan], lambda hf: process(plan[hf], hf))
    config.save_pretrained(str(out))
    _add_legacy_keys(out / "config.json")
    AutoTokenizer.from_pretrained(src, gguf_file=name).save_pretrained(str(out))
    _portable_tokenizer_config(out / "tokenizer_config.json", config.max_position_embeddings)
    _write_generation_config(config, meta, out)
    provenance = {"importer_version": IMPORTER_VERSION, "source": str(gguf), "sha256": digest,
                  "architecture": arch, "tensor_types": dict(types),
                  "stored_dtype": "float32", "dequantized": bool(quantized)}
    (out / PROVENANCE).write_text(json.dumps(provenance, indent=2, sort_keys=True) + "\n")
    for f in out.iterdir():
        f.chmod(0o644)  # the shard writer makes private files; the cache is read by other users' pods too


def _tensor_plan(gguf: Path, header: gguf_header.Header, skeleton: Any,
                 expected: dict[str, tuple[int, ...]]) -> tuple[dict[str, tuple[str, ...]], Any]:
    """{HF name: GGUF name} of the tensors to write, every shape checked against the model the
    metadata describes before any is dequantized, and the function that converts one."""
    import gguf as gguf_lib
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
        load_gguf_checkpoint,
    )

    parsed = load_gguf_checkpoint(str(gguf), return_tensors=False)["config"]
    processor = TENSOR_PROCESSORS.get(header.architecture, TensorProcessor)(config=parsed)
    to_hf = get_gguf_hf_weights_map(skeleton, processor)
    # An MoE layer's gate and up experts are two GGUF tensors (E, I, H) that make one HF tensor
    # (E, 2I, H), gate rows first: a plan entry is every GGUF tensor of its HF tensor, in order.
    parts: dict[str, list[str]] = {}
    for t in sorted(header.tensors, key=lambda t: "ffn_up_exps" in t.name):
        if to_hf.get(t.name) in expected:
            parts.setdefault(to_hf[t.name], []).append(t.name)
    plan = {hf: tuple(names) for hf, names in parts.items()}
    missing = sorted(set(expected) - set(plan))
    if missing:
        raise GGUFError(f"{gguf.name} lacks tensors the model needs: {missing[:4]}")
    shapes = {t.name: t.shape for t in header.tensors}
    misshapen = [f"{' + '.join(g)} {_joined([shapes[n] for n in g])} != {expected[hf]}" for hf, g in plan.items()
                 if _joined([shapes[n] for n in g]) != expected[hf]]
    if misshapen:
        raise GGUFError(f"{gguf.name}: tensor shapes disagree with its metadata: {misshapen[:3]}")
    reader = gguf_lib.GGUFReader(str(gguf))
    by_name = {t.name: t for t in reader.tensors}

    def convert(gguf_names: tuple[str, ...], hf_name: str) -> Any:
        import numpy as np

        weights = [gguf_lib.quants.dequantize(by_name[n].data, by_name[n].tensor_type) for n in gguf_names]
        if "_exps" in gguf_names[0]:  # stacked experts: stored as HF holds them, bar the gate/up join
            return np.concatenate(weights, axis=1) if len(weights) > 1 else weights[0]
        return processor.process(weights=weights[0], name=gguf_names[0], tensor_key_mapping=to_hf,
                                 parsed_parameters={"config": parsed}).weights

    return plan, convert


def _joined(shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of tensors joined along dim 1 (one tensor: its own shape)."""
    if len(shapes) == 1:
        return tuple(shapes[0])
    if any(len(s) != 3 or s[0] != shapes[0][0] or s[2] != shapes[0][2] for s in shapes):
        return (-1,)  # cannot be joined: reported as a shape mismatch
    return (shapes[0][0], sum(s[1] for s in shapes), shapes[0][2])


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
