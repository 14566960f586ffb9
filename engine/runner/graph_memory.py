"""What CUDA graphs keep allocated for their whole life, counted before the KV pool is sized.

The graph runner (cuda_graph_runner.py) allocates after the pool, so whatever it holds must
be in the pool's reserve (kvcache/kv_memory.py: reserve_bytes), or capture runs out of memory
on a device the pool filled:

    inputs   DecodeGraphInputs' static buffers, max_bs rows
    index    FlashInfer's fixed page-table buffers, shared by every bucket (the one backend
             with graph hooks): max_bs * ceil(max_context_len / page_size) page indices
    outputs  each bucket's own fp32 logits, bs x vocab, alive as long as its graph
    pool     the largest capture's activations and half-precision logits, kept in the graphs'
             private memory pool; smaller buckets reuse it

An upper bound: a smaller bucket's output may be carved from the pool's freed blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.attention.flashinfer_backend import graph_index_buffers
from tandem.engine.kvcache.kv_memory import activation_bytes_per_token
from tandem.engine.model_config import ModelConfig, RunnerConfig
from tandem.engine.runner.cuda_graph_runner import graph_buckets
from tandem.engine.runner.graph_inputs import DecodeGraphInputs

_META = torch.device("meta")  # shapes and dtypes without an allocation


@dataclass(frozen=True)
class GraphMemory:
    inputs: int
    index: int
    outputs: int
    pool: int

    @property
    def total(self) -> int:
        return self.inputs + self.index + self.outputs + self.pool


def graph_memory(mc: ModelConfig, config: RunnerConfig, dtype: torch.dtype, max_context_len: int) -> GraphMemory:
    """Bytes the graphs of `config.graph_max_bs` hold, from the same constructors the runner uses."""
    buckets = graph_buckets(config.graph_max_bs)
    max_bs = buckets[-1]
    max_pages = -(-max_context_len // config.page_size)
    el = torch.tensor([], dtype=dtype).element_size()
    return GraphMemory(
        inputs=sum(t.nbytes for t in DecodeGraphInputs(max_bs, _META).buffers()),
        index=sum(t.nbytes for t in graph_index_buffers(max_bs, max_pages, _META)),
        outputs=sum(buckets) * mc.vocab_size * 4,
        pool=max_bs * (activation_bytes_per_token(mc, dtype) + mc.vocab_size * el),
    )
