"""A GGUF file's header, read within bounds before anything else reads the file.

The `gguf` package's reader trusts the header: it loops over whatever counts the file
states, makes a numpy view per array item, and slices past the end of the file without a
word. A hostile or truncated file could make it allocate gigabytes, or hand garbage to the
conversion. This reader walks the same layout with plain reads and checks every count and
length against the bytes actually left in the file and against fixed limits first, so a
malformed file costs at most its own size to reject, with a GGUFError that says what is wrong.

Layout (GGUF v2/v3, little-endian): magic, version, tensor count, kv count; the kv pairs
(key string, value type, value; arrays are item type, count, items); the tensor infos (name,
dims, type, offset); padding to the alignment; the tensor data.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from tandem.engine.modelgen.model_spec import ARCHITECTURES

MAGIC = b"GGUF"
VERSIONS = (2, 3)
# Limits far above any real checkpoint (Llama 3.1 405B: 1.1k tensors, ~40 keys, 128k tokens,
# 126 layers; the largest vocabularies are ~262k) and far below what would hurt this process.
MAX_TENSORS = 1 << 16
MAX_KV = 1 << 12
MAX_KEY_BYTES = 1 << 10
MAX_STRING_BYTES = 1 << 22  # a chat template is tens of KiB
MAX_ARRAY_ITEMS = 1 << 21  # one array: tokens, scores, token types, merges
MAX_TOTAL_ARRAY_ITEMS = 1 << 23  # all arrays together: the `gguf` reader keeps ~100 B per item
MAX_TENSOR_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16
MAX_BLOCKS = 1024  # layers; also at most the tensor count (every layer has tensors)
MAX_MODEL_DIM = 1 << 20  # hidden, FFN, heads, head size
MAX_EXPERTS = 1024  # a mixture-of-experts layer's experts (DeepSeek-V3 has 256)
# GGUF's architecture name -> the HF class it converts to; llama.cpp names Qwen3-MoE "qwen3moe".
GGUF_ARCHITECTURES = {**ARCHITECTURES, "qwen3moe": "Qwen3MoeForCausalLM"}
MOE_GGUF_ARCHITECTURES = frozenset({"qwen3moe"})
MAX_CONTEXT = 1 << 26
DEFAULT_ALIGNMENT = 32

# Value types: struct format of the fixed-size ones; 8 is a string, 9 an array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """The file is not a GGUF checkpoint this importer can read."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dims: tuple[int, ...]  # GGUF order: the fastest-varying dimension first (the reverse of torch's)
    type_name: str  # GGMLQuantizationType name: F32, Q8_0, ...
    nbytes: int

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(reversed(self.dims))


@dataclass(frozen=True)
class Header:
    version: int
    metadata: dict[str, Any]  # the scalar and string values
    array_lengths: dict[str, int]  # the arrays, by their item count (their items are not kept)
    tensors: tuple[TensorInfo, ...]
    data_offset: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture"))

    def tensor_types(self) -> Counter[str]:
        return Counter(t.type_name for t in self.tensors)


class _Reader:
    """Reads that never go past the end of the file, each one checked before it is made."""

    def __init__(self, f: BinaryIO, size: int, name: str) -> None:
        self.f, self.size, self.name, self.pos = f, size, name, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.name} is not a readable GGUF file ({what}, at byte {self.pos})")

    def take(self, n: int, what: str) -> bytes:
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.size - self.pos} are left")
        data = self.f.read(n)
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(f"truncated: {what} needs {n} bytes, {self.size - self.pos} are left")
        self.pos += n
        self.f.seek(self.pos)

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, limit: int, what: str) -> str:
        n = self.unpack("<Q", f"{what}'s length")
        if n > limit:
            raise self.fail(f"{what} is {n} bytes long, more than {limit}")
        try:
            return self.take(n, what).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} is not UTF-8") from None


def read(path: Path) -> Header:
    """The header of the GGUF at `path`, every count checked; GGUFError if it is malformed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        r = _Reader(f, size, path.name)
        if r.take(4, "the magic") != MAGIC:
            raise r.fail("no GGUF magic")
        version = r.unpack("<I", "the version")
        if version not in VERSIONS:
            raise r.fail(f"version {version}; this reader knows {VERSIONS} (little-endian)")
        tensor_count, kv_count = r.unpack("<Q", "the tensor count"), r.unpack("<Q", "the kv count")
        # The smallest kv pair is 13 bytes (empty key, type, a u8); a tensor info 24 (empty name, no dims).
        if kv_count > min(MAX_KV, (size - r.pos) // 13):
            raise r.fail(f"{kv_count} metadata pairs, more than the file could hold or {MAX_KV}")
        if tensor_count > min(MAX_TENSORS, (size - r.pos) // 24):
            raise r.fail(f"{tensor_count} tensors, more than the file could hold or {MAX_TENSORS}")
        metadata, arrays = _read_kv(r, kv_count)
        tensors = [_read_tensor_info(r, i) for i in range(tensor_count)]
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not (isinstance(alignment, int) and 0 < alignment <= MAX_ALIGNMENT and alignment & (alignment - 1) == 0):
            raise r.fail(f"general.alignment {alignment!r} is not a power of two up to {MAX_ALIGNMENT}")
        data_offset = -(-r.pos // alignment) * alignment
        infos = _place_tensors(r, tensors, data_offset, alignment)
    return Header(version, metadata, arrays, infos, data_offset)


def _read_kv(r: _Reader, count: int) -> tuple[dict[str, Any], dict[str, int]]:
    metadata: dict[str, Any] = {}
    arrays: dict[str, int] = {}
    total_items = 0
    for _ in range(count):
        key = r.string(MAX_KEY_BYTES, "a metadata key")
        if key in metadata or key in arrays:
            raise r.fail(f"metadata key {key[:80]!r} appears twice")
        kind = r.unpack("<I", f"{key[:80]}'s type")
        if kind == _ARRAY:
            item = r.unpack("<I", f"{key[:80]}'s item type")
            n = r.unpack("<Q", f"{key[:80]}'s length")
            total_items += n
            if n > MAX_ARRAY_ITEMS or total_items > MAX_TOTAL_ARRAY_ITEMS:
                raise r.fail(f"array {key[:80]!r} has {n} items: more than {MAX_ARRAY_ITEMS} in one array or "
                             f"{MAX_TOTAL_ARRAY_ITEMS} in all")
            _skip_array(r, key, item, n)
            arrays[key] = n
        else:
            metadata[key] = _read_scalar(r, key, kind)
    return metadata, arrays


def _read_scalar(r: _Reader, key: str, kind: int) -> Any:
    if kind == _STRING:
        return r.string(MAX_STRING_BYTES, repr(key[:80]))
    if kind not in _SCALARS:
        raise r.fail(f"{key[:80]!r} has value type {kind}, which GGUF does not define")
    return r.unpack(_SCALARS[kind], repr(key[:80]))


def _skip_array(r: _Reader, key: str, item: int, n: int) -> None:
    if item in _SCALARS:
        r.skip(n * struct.calcsize(_SCALARS[item]), f"array {key[:80]!r}")
    elif item == _STRING:
        for _ in range(n):  # each string walked: its length is in the file
            r.skip(_checked_length(r, key), f"a string of {key[:80]!r}")
    else:  # nested arrays: no model file uses them, and the `gguf` reader flattens them wrongly
        raise r.fail(f"array {key[:80]!r} holds items of type {item}")


def _checked_length(r: _Reader, key: str) -> int:
    n = r.unpack("<Q", f"a string length in {key[:80]!r}")
    if n > MAX_STRING_BYTES:
        raise r.fail(f"a string in {key[:80]!r} is {n} bytes long, more than {MAX_STRING_BYTES}")
    return n


def _read_tensor_info(r: _Reader, i: int) -> tuple[str, tuple[int, ...], int, int]:
    name = r.string(MAX_KEY_BYTES, f"tensor {i}'s name")
    n_dims = r.unpack("<I", f"tensor {name[:80]!r}'s dimension count")
    if not 1 <= n_dims <= MAX_TENSOR_DIMS:
        raise r.fail(f"tensor {name[:80]!r} has {n_dims} dimensions (1 to {MAX_TENSOR_DIMS})")
    dims = tuple(r.unpack("<Q", f"tensor {name[:80]!r}'s dimensions") for _ in range(n_dims))
    kind = r.unpack("<I", f"tensor {name[:80]!r}'s type")
    offset = r.unpack("<Q", f"tensor {name[:80]!r}'s offset")
    return name, dims, kind, offset


def _place_tensors(r: _Reader, tensors: list[tuple[str, tuple[int, ...], int, int]], data_offset: int,
                   alignment: int) -> tuple[TensorInfo, ...]:
    """Each tensor's size from its type and dims, and its bytes within the file: a tensor whose
    data lies past the end is refused here, not found out while it is converted."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    infos, names = [], set()
    for name, dims, kind, offset in tensors:
        if name in names:
            raise r.fail(f"tensor {name[:80]!r} appears twice")
        names.add(name)
        try:
            qtype = GGMLQuantizationType(kind)
            block, type_size = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise r.fail(f"tensor {name[:80]!r} has type {kind}, which this reader does not know") from None
        if min(dims) < 1 or dims[0] % block:
            raise r.fail(f"tensor {name[:80]!r} has dims {dims}: each must be positive, the first a multiple of "
                         f"{qtype.name}'s block of {block}")
        elements = 1
        for d in dims:
            elements *= d
        nbytes = elements // block * type_size
        start = data_offset + offset
        if offset % alignment or start + nbytes > r.size:
            raise r.fail(f"tensor {name[:80]!r} ({qtype.name}, dims {dims}, {nbytes} bytes at offset {offset}) "
                         f"lies outside the file's {r.size} bytes or off its {alignment}-byte alignment")
        infos.append(TensorInfo(name, dims, qtype.name, nbytes))
    return tuple(infos)


def check_model(header: Header, name: str) -> None:
    """The metadata the conversion sizes things by: a supported architecture, and layer count
    and dimensions that are positive integers within bounds (the layer count also at most the
    tensor count: the conversion builds one module per layer before it reads any tensor)."""
    arch = header.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(f"{name}: architecture {arch!r} is not supported "
                        f"(supported: {', '.join(GGUF_ARCHITECTURES)})")
    experts = header.metadata.get(f"{arch}.expert_count")
    if arch not in MOE_GGUF_ARCHITECTURES and experts:
        # llama.cpp writes Mixtral as "llama" with experts; transformers reads no such file
        raise GGUFError(f"{name}: a {arch} file with {experts!r} experts (Mixtral's GGUF form) is not supported; "
                        "serve its HF directory instead")
    bounds = {"block_count": min(MAX_BLOCKS, len(header.tensors)), "embedding_length": MAX_MODEL_DIM,
              "feed_forward_length": MAX_MODEL_DIM, "attention.head_count": MAX_MODEL_DIM,
              "attention.head_count_kv": MAX_MODEL_DIM, "attention.key_length": MAX_MODEL_DIM,
              "attention.value_length": MAX_MODEL_DIM, "context_length": MAX_CONTEXT, "vocab_size": MAX_ARRAY_ITEMS}
    required: tuple[str, ...] = ("block_count", "embedding_length", "feed_forward_length", "attention.head_count")
    if arch in MOE_GGUF_ARCHITECTURES:
        bounds |= {"expert_count": MAX_EXPERTS, "expert_used_count": MAX_EXPERTS,
                   "expert_feed_forward_length": MAX_MODEL_DIM}
        required += ("expert_count", "expert_used_count", "expert_feed_forward_length")
    for key, limit in bounds.items():
        value = header.metadata.get(f"{arch}.{key}")
        if value is None and key not in required:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= limit:
            raise GGUFError(f"{name}: {arch}.{key} is {value!r}; it must be an integer from 1 to {limit}")
    used = header.metadata.get(f"{arch}.expert_used_count")
    if used is not None and used > header.metadata[f"{arch}.expert_count"]:
        raise GGUFError(f"{name}: {arch}.expert_used_count {used} exceeds the {experts} experts")
    if "tokenizer.ggml.tokens" not in header.array_lengths:
        raise GGUFError(f"{name}: has no tokenizer (tokenizer.ggml.tokens)")
