"""Train and save real byte-level BPE tokenizers without downloading anything.

Data flow: stdlib .py files (sorted, capped) -> `tokenizers` BPE trainer -> cached
tokenizer.json per (family, vocab_size) -> HF `PreTrainedTokenizerFast` with the
family's special tokens and chat template, saved next to a model's weights.

Special tokens are appended after the trained merges, so they get the highest ids,
as in real Qwen2 and Llama-3 vocabularies.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# Bump when the corpus or trainer recipe changes, so stale cached tokenizers are not reused.
TOKENIZER_RECIPE_VERSION = 1

# Pre-tokenizer regexes of the real families; they differ only in digit grouping.
_QWEN_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
_LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


@dataclass(frozen=True)
class TokenizerFamily:
    """Special tokens and conventions shared by the archs of one model family."""

    name: str
    specials: tuple[str, ...]
    bos: str
    eos: str  # the chat end-of-turn token; generation stops on it
    extra_eos: str  # the document end token; generation also stops on it
    pad: str
    add_bos: bool  # Llama-3 prepends BOS on encode; Qwen never does
    split_regex: str
    chat_template: str


FAMILIES: dict[str, TokenizerFamily] = {
    "qwen": TokenizerFamily(
        name="qwen",
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        bos="<|endoftext|>",
        eos="<|im_end|>",
        extra_eos="<|endoftext|>",
        pad="<|endoftext|>",
        add_bos=False,
        split_regex=_QWEN_SPLIT,
        chat_template=_CHATML_TEMPLATE,
    ),
    "llama3": TokenizerFamily(
        name="llama3",
        specials=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
        ),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        extra_eos="<|end_of_text|>",
        pad="<|end_of_text|>",
        add_bos=True,
        split_regex=_LLAMA3_SPLIT,
        chat_template=_LLAMA3_TEMPLATE,
    ),
}

_ARCH_FAMILY = {"llama": "llama3", "qwen2": "qwen", "qwen3": "qwen", "qwen3_moe": "qwen", "mixtral": "llama3"}


@dataclass(frozen=True)
class SpecialIds:
    """Token ids that config.json and generation_config.json must agree on."""

    bos: int
    eos: int
    eos_all: tuple[int, ...]
    pad: int


def family_for_arch(arch: str) -> TokenizerFamily:
    return FAMILIES[_ARCH_FAMILY[arch]]


def special_ids(tokenizer: Tokenizer, family: TokenizerFamily) -> SpecialIds:
    ids = {tok: tokenizer.token_to_id(tok) for tok in family.specials}
    return SpecialIds(
        bos=ids[family.bos],
        eos=ids[family.eos],
        eos_all=(ids[family.eos], ids[family.extra_eos]),
        pad=ids[family.pad],
    )


def _corpus_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root).parts
        # Installed third-party packages live under the stdlib dir but differ per machine.
        if not any(part in ("site-packages", "dist-packages", "__pycache__") for part in rel):
            files.append(path)
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def corpus_budget(vocab_size: int) -> int:
    """Bytes of training text: enough for the merges wanted, small enough to train in seconds."""
    return min(4 << 20, max(256 << 10, vocab_size * 256))


def iter_corpus(max_bytes: int) -> Iterator[str]:
    used = 0
    for path in _corpus_files():
        if used >= max_bytes:
            return
        data = path.read_bytes()[: max_bytes - used]
        used += len(data)
        yield data.decode("utf-8", errors="replace")


def _new_tokenizer(family: TokenizerFamily) -> Tokenizer:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(family.split_regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _post_processor(family: TokenizerFamily, bos_id: int):  # -> tokenizers.processors.PostProcessor
    from tokenizers import processors

    byte_level = processors.ByteLevel(trim_offsets=False)
    if not family.add_bos:
        return byte_level
    bos = family.bos
    template = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, bos_id)]
    )
    return processors.Sequence([byte_level, template])


def train_tokenizer(family: TokenizerFamily, vocab_size: int) -> Tokenizer:
    """Train a BPE tokenizer whose vocabulary is exactly `vocab_size` including specials."""
    from tokenizers import AddedToken, pre_tokenizers, trainers

    n_special = len(family.specials)
    if vocab_size < 256 + n_special:
        raise ValueError(f"vocab_size {vocab_size} cannot hold 256 bytes plus {n_special} specials")
    tok = _new_tokenizer(family)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - n_special,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
        show_progress=False,
    )
    tok.train_from_iterator(iter_corpus(corpus_budget(vocab_size)), trainer=trainer)
    # A small corpus can run out of merges; reserved tokens fill the gap, as Llama-3 does.
    n_reserved = vocab_size - n_special - tok.get_vocab_size()
    reserved = [f"<|reserved_special_token_{i}|>" for i in range(n_reserved)]
    tok.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in family.specials + tuple(reserved)]
    )
    tok.post_processor = _post_processor(family, tok.token_to_id(family.bos))
    assert tok.get_vocab_size() == vocab_size, (tok.get_vocab_size(), vocab_size)
    return tok


def _cache_key(family: TokenizerFamily, vocab_size: int) -> str:
    # The stdlib differs between Python versions, so the version is part of the key.
    recipe = json.dumps([TOKENIZER_RECIPE_VERSION, family.name, vocab_size, sys.version_info[:2]])
    return f"{family.name}-{vocab_size}-{hashlib.sha256(recipe.encode()).hexdigest()[:10]}"


def cached_tokenizer(family: TokenizerFamily, vocab_size: int, cache_dir: Path) -> Tokenizer:
    """Load the trained tokenizer from `cache_dir/tokenizers`, training it on a miss."""
    from tokenizers import Tokenizer

    path = cache_dir / "tokenizers" / f"{_cache_key(family, vocab_size)}.json"
    if path.is_file():
        return Tokenizer.from_file(str(path))
    tok = train_tokenizer(family, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: a concurrent reader sees either no file or a whole one.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    tok.save(tmp)
    os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is shared like the models
    os.replace(tmp, path)
    return tok


def save_hf_tokenizer(
    tok: Tokenizer, family: TokenizerFamily, out_dir: Path, model_max_length: int
) -> SpecialIds:
    """Write tokenizer.json + tokenizer_config.json (with chat_template) loadable by AutoTokenizer."""
    from transformers import PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=family.bos,
        eos_token=family.eos,
        pad_token=family.pad,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = family.chat_template
    hf_tok.save_pretrained(str(out_dir))
    _patch_tokenizer_config(out_dir, family.chat_template)
    return special_ids(tok, family)


def _patch_tokenizer_config(out_dir: Path, template: str) -> None:
    # Newer transformers write chat_template.jinja and a v5-only class name; older readers
    # (and ours) look for the template in tokenizer_config.json and need a class they know.
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = template
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
