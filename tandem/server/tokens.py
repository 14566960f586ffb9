"""Tokenization in the front: prompts, chat templates, token text for logprobs, and the
checks against the model's limits that turn an oversized request into a 400.

The handlers tokenize through `encode_many` and `chat_ids`, on a small thread pool: a
megabyte prompt or a long conversation through a Jinja template takes the CPU for a good
fraction of a second, which on the event loop would stall every other stream's tokens. The
Rust tokenizers release the GIL, so the pool runs beside the loop, not just instead of it.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from typing import Any

from tandem.web.errors import bad_request


class Tokens:
    def __init__(self, tokenizer: Any, info: dict[str, Any]) -> None:
        self.tok = tokenizer
        self.max_context_len = int(info["max_context_len"])
        self.capacity_tokens = int(info["capacity_tokens"])
        self.vocab_size = int(info["vocab_size"])
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tandem-tokenize")

    async def encode_many(self, prompts: list[str | list[int]]) -> list[list[int]]:
        """Every prompt's ids, tokenized off the event loop."""
        if all(not isinstance(p, str) for p in prompts):  # ids only: a range check, no tokenizer
            return [self.encode(p) for p in prompts]
        return await asyncio.get_running_loop().run_in_executor(self.pool, lambda: [self.encode(p) for p in prompts])

    async def chat_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The templated conversation's ids, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.chat, messages, tools)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tok.encode(prompt))
        bad = [t for t in prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation through the model's template; `tools` in OpenAI's shape, as templates
        that render tools expect them (a template that does not simply leaves them out)."""
        if getattr(self.tok, "chat_template", None) is None:
            raise bad_request("this model has no chat template; use /v1/completions", param="messages")
        try:
            text = self.tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template may reject a conversation (roles out of order, ...)
            raise bad_request(f"the chat template rejected the messages: {exc}", param="messages") from None
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def _token_text(self, token_id: int) -> str:
        return self.tok.decode([token_id])

    def max_new_tokens(self, prompt_len: int, requested: int | None) -> int:
        """The request's generation budget; 400 when prompt + budget cannot fit.
        None means "as much as fits" (OpenAI's chat default)."""
        limit = min(self.max_context_len, self.capacity_tokens)
        if requested is None:
            if prompt_len >= limit:
                raise bad_request(f"the prompt ({prompt_len} tokens) leaves no room to generate within "
                                  f"this model's limit of {limit} tokens", code="context_length_exceeded")
            return limit - prompt_len
        if prompt_len + requested > self.max_context_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_context_len} tokens. However, you "
                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, {requested} in the "
                f"completion).", code="context_length_exceeded", param="max_tokens")
        if prompt_len + requested > self.capacity_tokens:
            raise bad_request(f"the request needs {prompt_len + requested} tokens of KV cache; this worker's "
                              f"pool holds {self.capacity_tokens}", code="context_length_exceeded",
                              param="max_tokens")
        return requested
