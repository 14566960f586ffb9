"""A minimal PD router for tests: the same body to a prefill and a decode worker, with
bootstrap fields added (as sglang-router does), answering with decode's response."""

from __future__ import annotations

import concurrent.futures as cf
import random
from typing import Any

import httpx
from worker_process import Worker


def pd_body(prefill: Worker, body: dict[str, Any], room: int | None = None) -> dict[str, Any]:
    """`body` with the bootstrap fields that pair it with `prefill`."""
    return {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.bootstrap,
            "bootstrap_room": random.randrange(2**63) if room is None else room}


def pd_post(prefill: Worker, decode: Worker, path: str, body: dict[str, Any],
            room: int | None = None) -> tuple[httpx.Response, httpx.Response]:
    body = pd_body(prefill, body, room)
    with cf.ThreadPoolExecutor(2) as ex:
        p = ex.submit(prefill.post, path, body)
        d = ex.submit(decode.post, path, body)
        return p.result(), d.result()


def pd_generate(prefill: Worker, decode: Worker, body: dict[str, Any]) -> dict[str, Any]:
    p, d = pd_post(prefill, decode, "/generate", body)
    assert d.status_code == 200, d.text
    return d.json()


def pd_stats(w: Worker) -> list[dict[str, Any]]:
    return [r["pd"] for r in w.pool()["ranks"]]
