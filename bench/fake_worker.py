"""A fake worker for router benchmarks: the endpoints sgl-router and `tandem router` use, with
a fixed time to first token and inter-token gap instead of a model, so what is measured is
the proxy, not the machine's model speed.

    python bench/fake_worker.py --port 9001 --ttft 0.02 --itl 0.005 --tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse


def build(ttft: float, itl: float, tokens: int) -> FastAPI:
    app = FastAPI()
    info = {"model_path": "fake", "tokenizer_path": "fake", "is_generation": True, "served_model_name": "tiny"}

    @app.get("/health")
    @app.get("/health/ready")
    @app.get("/health_generate")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/get_model_info")
    async def model_info() -> dict:
        return info

    @app.get("/get_server_info")
    async def server_info() -> dict:
        return {**info, "disaggregation_mode": "null"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "tiny", "object": "model"}]}

    def meta(n: int) -> dict:
        return {"id": "x", "finish_reason": {"type": "length", "length": n}, "prompt_tokens": 8,
                "completion_tokens": n, "cached_tokens": 0}

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await request.json()
        if body.get("stream"):
            async def gen():
                await asyncio.sleep(ttft)
                for i in range(tokens):
                    yield f"data: {json.dumps({'text': 'x' * (i + 1), 'meta_info': meta(i + 1)})}\n\n"
                    await asyncio.sleep(itl)
                yield "data: [DONE]\n\n"
            return StreamingResponse(gen(), media_type="text/event-stream")
        t0 = time.monotonic()
        await asyncio.sleep(ttft + itl * (tokens - 1) - (time.monotonic() - t0))
        return JSONResponse({"text": "x" * tokens, "output_ids": [1] * tokens, "meta_info": meta(tokens)})

    return app


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ttft", type=float, default=0.02)
    p.add_argument("--itl", type=float, default=0.005)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    uvicorn.run(build(a.ttft, a.itl, a.tokens), host=a.host, port=a.port, log_level="warning")
