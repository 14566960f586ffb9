"""One streamed request against an OpenAI-compatible endpoint, timed chunk by chunk.

TTFT is send to the first chunk that carries output text; ITL is the gap between
consecutive text chunks (a chunk holding several tokens counts as one gap, as every
client sees it); token counts come from the server's `usage` (stream_options), or from
the chunk count where a server sends none.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx


@dataclass
class Result:
    ok: bool
    start: float  # perf_counter at send
    e2e: float = 0.0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first."""
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def _delta(chunk: dict, chat: bool) -> str:
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


async def send(client: httpx.AsyncClient, model: str, prompt: str | list[dict], max_tokens: int,
               ignore_eos: bool = True) -> Result:
    """`prompt` as a string goes to /v1/completions, as messages to /v1/chat/completions."""
    chat = not isinstance(prompt, str)
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True  # SGLang's, vLLM's and our extension: outputs of exactly max_tokens
    body["messages" if chat else "prompt"] = prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    res = Result(ok=False, start=time.perf_counter())
    last, chunks, parts = res.start, 0, []
    try:
        async with client.stream("POST", path, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:200]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "error" in chunk:
                    res.error = str(chunk["error"])[:200]
                    return res
                now, text = time.perf_counter(), _delta(chunk, chat)
                if text:
                    if res.ttft is None:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    parts.append(text)
                usage = chunk.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens") or 0
                    res.output_tokens = usage.get("completion_tokens") or 0
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"[:200]
        return res
    res.e2e = time.perf_counter() - res.start
    res.output_tokens = res.output_tokens or chunks
    res.text, res.ok = "".join(parts), True
    return res
