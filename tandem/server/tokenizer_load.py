"""The front's tokenizer, loaded without importing torch where that gives AutoTokenizer's own
answer.

AutoTokenizer picks the class from config.json's model type and the tokenizer config, and to
read them imports transformers' config machinery, which imports torch: about 2.7 s of every
worker's start on CPU (and ~190 MB of its front process), in a process that never runs a tensor
op. The model directories tandem writes itself, the model builder's and the GGUF importer's
(each marked by its provenance file), hold one `tokenizer.json` declared as
`PreTrainedTokenizerFast`. For the model types in DIRECT_MODEL_TYPES AutoTokenizer keeps that
declared class, and the front loads it so, directly; tests/server/test_tokenizer_load.py holds
each of them to AutoTokenizer's answer. For other types AutoTokenizer may substitute the type's
own class (qwen2's, for one), and any other directory, whatever it declares, goes through
AutoTokenizer too: its rules (byte-level Llama files, models whose hub class is known wrong)
are not repeated here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.engine.modelgen.gguf_import import PROVENANCE as IMPORTED
from tandem.engine.modelgen.model_builder import SPEC_FILE as BUILT

DIRECT_CLASS = "PreTrainedTokenizerFast"
DIRECT_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen3_moe", "mixtral"})


def load_tokenizer(model_path: str) -> Any:
    if loads_directly(Path(model_path)):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(model_path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


def loads_directly(root: Path) -> bool:
    """A directory tandem wrote, of a model type whose declared plain fast tokenizer
    AutoTokenizer keeps."""
    if not any((root / marker).is_file() for marker in (BUILT, IMPORTED)):
        return False
    try:
        tok = json.loads((root / "tokenizer_config.json").read_text())
        model = json.loads((root / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(tok, dict) and isinstance(model, dict) and tok.get("tokenizer_class") == DIRECT_CLASS
            and "auto_map" not in tok and "auto_map" not in model and model.get("model_type") in DIRECT_MODEL_TYPES)
