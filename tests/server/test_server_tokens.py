"""The front tokenizes off its event loop: prompts and chat templates run on the tokenizer pool."""

from __future__ import annotations

import asyncio
import threading

from tandem.server.tokens import Tokens


class RecordingTokenizer:
    chat_template = "{{ messages }}"

    def __init__(self) -> None:
        self.threads: list[str] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        return [ord(c) % 100 for c in text]

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool, tools=None) -> str:
        self.threads.append(threading.current_thread().name)
        return "".join(m["content"] for m in messages)


def test_prompts_and_chat_are_tokenized_off_the_event_loop() -> None:
    tok = RecordingTokenizer()
    tokens = Tokens(tok, {"max_context_len": 128, "capacity_tokens": 1024, "vocab_size": 100})

    async def main() -> tuple[list[list[int]], list[int], list[list[int]]]:
        texts = await tokens.encode_many(["ab", "c"])
        chat = await tokens.chat_ids([{"role": "user", "content": "hi"}])
        ids = await tokens.encode_many([[1, 2]])  # ids: checked in place, no tokenizer call
        return texts, chat, ids

    texts, chat, ids = asyncio.run(main())
    assert texts == [[97, 98], [99]] and chat == [4, 5] and ids == [[1, 2]]
    assert tok.threads and all(name.startswith("tandem-tokenize") for name in tok.threads)
