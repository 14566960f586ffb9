"""KVMemory: one worker's KV memory, built once and handed to whoever uses it.

    KVMemory.kv_pool     the KV store: one contiguous buffer, page allocator, layout()
    KVMemory.req_table   request row -> KV slots

`build_kv_memory` sizes it from what the device has left after the weights. The model
runner reads and writes it, the cache manager owns its pages and rows, and the PD
transfer agent registers `kv_pool.layout()`; none of them creates it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.engine.kvcache.memory_pool import TokenToKVPool
from tandem.engine.kvcache.req_table import ReqToTokenPool
from tandem.engine.runner.config import ModelConfig, RunnerConfig

# Upper bound for an automatically sized CPU pool; explicit max_total_tokens overrides it.
CPU_AUTO_MAX_TOKENS = 1 << 19


@dataclass
class KVMemory:
    kv_pool: TokenToKVPool
    req_table: ReqToTokenPool


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 4 << 30


def build_kv_memory(model_config: ModelConfig, config: RunnerConfig, dtype: torch.dtype, device: torch.device,
                    weight_bytes: int, max_context_len: int) -> KVMemory:
    """The pool gets config.max_total_tokens, or mem_fraction_static of the device's free
    memory minus the weights (capped on CPU)."""
    mc, P = model_config, config.page_size
    if config.max_total_tokens is not None:
        tokens = config.max_total_tokens
    else:
        per_token = mc.num_layers * 2 * mc.kv_size * torch.tensor([], dtype=dtype).element_size()
        budget = available_memory_bytes(device) * config.mem_fraction_static - weight_bytes
        tokens = max(int(budget // per_token), 4 * P)
        if device.type == "cpu":
            tokens = min(tokens, CPU_AUTO_MAX_TOKENS)
    num_pages = -(-tokens // P) + 1  # +1: the reserved page 0
    kv_pool = TokenToKVPool(num_pages, P, mc.num_layers, mc.num_kv_heads, mc.head_dim, dtype, device)
    # Twice the running cap: rows of requests that finished in one step are held
    # (not reusable) until the next result, while a full batch is admitted.
    req_table = ReqToTokenPool(2 * config.max_running_requests, max_context_len, device)
    return KVMemory(kv_pool, req_table)
