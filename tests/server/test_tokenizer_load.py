"""The front loads a tandem-made model's tokenizer without AutoTokenizer (and so without torch):
it must be AutoTokenizer's own tokenizer, ids, templates and text alike. Anything else goes
through AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tandem.server.tokenizer_load import load_tokenizer, loads_directly

TEXTS = ["Hello world", "  leading spaces, tabs\tand\nnewlines", "héllo wörld 日本語 🙂",
         "<|im_start|>user x<|im_end|>", ""]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                           "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}]


def same_as_auto(path: Path) -> None:
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(str(path)), AutoTokenizer.from_pretrained(str(path))
    assert type(ours) is type(auto)
    for text in TEXTS:
        assert ours.encode(text) == auto.encode(text)
        assert ours.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
        ids = auto.encode(text)
        assert ours.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert ours.chat_template == auto.chat_template
    if auto.chat_template is not None:
        for tools in (None, TOOLS):
            kw = {"tools": tools, "add_generation_prompt": True, "tokenize": False}
            assert ours.apply_chat_template(CHAT, **kw) == auto.apply_chat_template(CHAT, **kw)
    assert ours.all_special_ids == auto.all_special_ids
    assert (ours.eos_token, ours.bos_token, ours.pad_token) == (auto.eos_token, auto.bos_token, auto.pad_token)
    assert ours.convert_ids_to_tokens(list(range(50))) == auto.convert_ids_to_tokens(list(range(50)))


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-qwen3-moe", "tiny-mixtral", "small"])
def test_a_built_models_tokenizer_is_autotokenizers(model_path, preset):
    """One preset of each model type in DIRECT_MODEL_TYPES."""
    assert loads_directly(model_path(preset))
    same_as_auto(model_path(preset))


def test_a_type_whose_class_autotokenizer_substitutes_goes_through_it(model_path):
    """qwen2: AutoTokenizer loads Qwen2Tokenizer for the plain class the directory declares."""
    assert not loads_directly(model_path("tiny-qwen2"))
    same_as_auto(model_path("tiny-qwen2"))


def test_an_imported_real_models_tokenizer_is_autotokenizers(smollm2):
    assert loads_directly(smollm2)
    same_as_auto(smollm2)


def test_another_directory_goes_through_autotokenizer(smollm2, tmp_path):
    """The same files without tandem's provenance, declaring a class AutoTokenizer overrides
    (a byte-level tokenizer.json named LlamaTokenizer: it loads the plain backend instead)."""
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(smollm2 / name, tmp_path / name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "LlamaTokenizer"}))
    assert not loads_directly(tmp_path)
    same_as_auto(tmp_path)
    (tmp_path / "tandem_import.json").write_text("{}")  # marked, but the class is not the plain one
    assert not loads_directly(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("not json")
    assert not loads_directly(tmp_path)


def test_loading_a_built_models_tokenizer_imports_no_torch(model_path):
    code = ("import sys; from tandem.server.tokenizer_load import load_tokenizer; "
            f"load_tokenizer({str(model_path('tiny'))!r}); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
