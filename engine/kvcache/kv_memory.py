"""KVMemory: one worker's KV memory, built once and handed to whoever uses it.

    KVMemory.kv_pool     the KV store: one contiguous buffer, page allocator, layout()
    KVMemory.req_table   request row -> KV slots

`build_kv_memory` sizes it from what the device has left after the weights. The model
runner reads and writes it, the cache manager owns its pages and rows, and the PD
transfer agent registers `kv_pool.layout()`; none of them creates it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.kvcache.kv_scales import KVScales
from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.model_config import ModelConfig, RunnerConfig

# Upper bound for an automatically sized CPU pool; explicit max_total_tokens overrides it.
CPU_AUTO_MAX_TOKENS = 1 << 19


@dataclass
class KVMemory:
    kv_pool: TokenToKVPool
    req_table: ReqToTokenPool


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the device: CUDA's own counts, MemTotal/MemAvailable on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        info[key] = int(rest.split()[0]) * 1024
    return info.get("MemTotal", 8 << 30), info.get("MemAvailable", 4 << 30)


def activation_bytes_per_token(mc: ModelConfig, dtype: torch.dtype) -> int:
    """The live tensors of a forward's widest layer, per token."""
    el = torch.tensor([], dtype=dtype).element_size()
    return (4 * mc.hidden_size + 3 * mc.intermediate_size + mc.q_size + 2 * mc.kv_size) * el


def req_table_rows(config: RunnerConfig) -> int:
    """Twice the running cap: rows of requests that finished in one step are held (not
    reusable) until the next result, while a full batch is admitted."""
    return 2 * config.max_running_requests


def req_table_bytes(config: RunnerConfig, max_context_len: int) -> int:
    """The int32 request-row table, allocated on the device after the pool is sized."""
    return req_table_rows(config) * max_context_len * torch.tensor([], dtype=torch.int32).element_size()


def reserve_bytes(mc: ModelConfig, config: RunnerConfig, dtype: torch.dtype, device: torch.device,
                  max_context_len: int, graph_bytes: int = 0) -> int:
    """What must stay free beside weights and KV: the activations of the largest forward, fp32
    logits and the sampler's copies of them for a full decode batch, the request-row table,
    what CUDA graphs keep for their life (`graph_bytes`, runner/graph_memory.py), and on CUDA
    a fixed 1 GiB for the attention workspace and allocator slack."""
    tokens = max(config.max_forward_tokens, config.max_running_requests)
    logits = 3 * config.max_running_requests * mc.vocab_size * 4
    fixed = (1 << 30) if device.type == "cuda" else 0
    return (tokens * activation_bytes_per_token(mc, dtype) + logits + req_table_bytes(config, max_context_len)
            + graph_bytes + fixed)


def kv_budget_bytes(total: int, free: int, weight_bytes: int, fraction: float, reserve: int) -> int:
    """Bytes for the KV pool, measured after the weights were loaded (so `free` already
    excludes them): weights + KV take `fraction` of the device's total memory, as SGLang's
    mem_fraction_static means, and whatever else is allocated must leave `reserve` free."""
    return max(0, min(int(total * fraction) - weight_bytes, free - reserve))


_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_storage_dtype(config: RunnerConfig, dtype: torch.dtype) -> torch.dtype:
    """What the pool stores K and V as: the model's dtype, or an fp8 format (a byte a value:
    twice the tokens in the same memory; attention upcasts what it reads)."""
    name = _FP8.get(config.kv_cache_dtype)
    return dtype if name is None else getattr(torch, name)


def build_kv_memory(model_config: ModelConfig, config: RunnerConfig, dtype: torch.dtype, device: torch.device,
                    weight_bytes: int, max_context_len: int, graph_bytes: int = 0,
                    agree: Callable[[int], int] = lambda tokens: tokens, scales: KVScales | None = None) -> KVMemory:
    """The pool gets config.max_total_tokens, or what kv_budget_bytes leaves (capped on CPU);
    `graph_bytes` is what the runner's CUDA graphs will hold, 0 without them. `agree` turns this
    process's token count into the one every tensor-parallel rank uses (their minimum)."""
    mc, P = model_config, config.page_size
    kv_dtype = kv_storage_dtype(config, dtype)
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    else:
        per_token = mc.num_layers * 2 * mc.kv_size * torch.tensor([], dtype=kv_dtype).element_size()
        total, free = device_memory(device)
        budget = kv_budget_bytes(total, free, weight_bytes, config.mem_fraction_static,
                                 reserve_bytes(mc, config, dtype, device, max_context_len, graph_bytes))
        tokens = max(budget // per_token, 4 * P)
        if device.type == "cpu":
            tokens = min(tokens, CPU_AUTO_MAX_TOKENS)
    num_pages = -(-agree(tokens) // P) + 1  # +1: the reserved page 0
    shard = mc.shard  # a tensor-parallel rank's pool holds its range of the KV heads
    kv_pool = TokenToKVPool(num_pages, P, mc.num_layers, mc.num_kv_heads, mc.head_dim, kv_dtype, device,
                            heads=None if shard is None else shard.kv_heads,
                            total_kv_heads=0 if shard is None else shard.total_kv_heads,
                            scales=scales if kv_dtype.itemsize == 1 else None)
    req_table = ReqToTokenPool(req_table_rows(config), max_context_len, device)
    return KVMemory(kv_pool, req_table)
