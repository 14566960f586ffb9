"""The router's tokenizer: HF's fast tokenizer (`tokenizers`, Rust) and the model's chat
template (jinja2, sandboxed, as transformers renders it), torch-free and transformers-free.

It must produce the ids a worker's front produces (tandem/server/tokens.py): prompts with
the tokenizer's special tokens, chat with the template's text encoded without them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer


class RouterTokenizer:
    real = True

    def __init__(self, model_dir: str) -> None:
        root = Path(model_dir)
        self.tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (root / "tokenizer_config.json").is_file():
            cfg = json.loads((root / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if template is None and (root / "chat_template.jinja").is_file():
            template = (root / "chat_template.jinja").read_text()
        self.specials = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token", "pad_token")}
        # The environment transformers renders templates in: loop controls ({% break %} in Qwen's
        # templates), strftime_now (Llama 3.x's date line), and a tojson that keeps non-ASCII and
        # '<' as they are (jinja's own escapes them for HTML, which would change the prompt's ids).
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.template = env.from_string(template) if isinstance(template, str) else None

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Raises ValueError when there is no template or it rejects the conversation."""
        if self.template is None:
            raise ValueError("this model has no chat template; use /v1/completions")
        try:
            text = self.template.render(messages=messages, tools=tools, add_generation_prompt=True, **self.specials)
        except Exception as exc:  # a template may reject a conversation (roles out of order, ...)
            raise ValueError(f"the chat template rejected the messages: {exc}") from None
        return self.tok.encode(text, add_special_tokens=False).ids


class ByteTokenizer:
    """Without the model's tokenizer (a router pod with no model mounted): UTF-8 bytes stand in
    for token ids. They serve routing only (prefix matching works on bytes as on tokens);
    workers then get the text, never these ids."""

    real = False

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Tools first, where templates put them: requests sharing them share a prefix."""
        head = json.dumps(tools, separators=(",", ":")) if tools else ""
        return list((head + json.dumps(messages, separators=(",", ":"))).encode())


def load_tokenizer(model_dir: str | None) -> RouterTokenizer | ByteTokenizer:
    return RouterTokenizer(model_dir) if model_dir else ByteTokenizer()


def _token_text(value: Any) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ValueError(message)
