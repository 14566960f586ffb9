"""ModelRunner: owns the weights and the attention backend; is handed the KV memory.

It turns a ForwardBatch into logits and logits into sampled ids, and knows
nothing about requests or scheduling; the scheduler drives it.

    runner = ModelRunner(path, config)        # weights only
    memory = runner.size_kv_memory()          # or any KVMemory built elsewhere
    runner.attach(memory)                     # attention backend, CUDA graphs
    ModelRunner.load(path, config)            # the three steps, for tests and benchmarks
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from tandem.engine.attention import choose_backend, create_backend, flashinfer_installed
from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.kernels import cpu_kernels, cpu_plan
from tandem.engine.kvcache.kv_memory import KVMemory, build_kv_memory
from tandem.engine.model_config import ModelConfig, RunnerConfig
from tandem.engine.models import layer_ops_choice
from tandem.engine.models.batch_invariant import make_batch_invariant
from tandem.engine.models.layers import can_pack_linears, pack_linears
from tandem.engine.models.loader import load_model
from tandem.engine.parallel.group import SINGLE, TPGroup
from tandem.engine.runner.future_map import FutureMap
from tandem.engine.runner.graph_memory import graph_memory
from tandem.engine.runner.sampler import SampleOutput, SamplingBatch, sample

log = logging.getLogger(__name__)

STREAM_COPY_MAX_GIB = 2.0  # cpu_stream_linears=None keeps plain weights up to this size (models to ~1B)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if name == "auto" else _DTYPES[name]
    plan = cpu_plan.current()
    if name == "auto":
        # bf16 pays off only with native bf16 arithmetic (AVX512-BF16 / AMX); elsewhere fp32 is faster.
        return torch.bfloat16 if torch.backends.mkldnn.is_available() and plan.native_bf16 else torch.float32
    if name == "bfloat16" and not plan.native_bf16:
        log.warning(
            "dtype=bfloat16 on a CPU without AVX512-BF16 or AMX: torch emulates bf16 matmuls here, "
            "several times slower than float32 (dtype=auto picks float32 on this CPU)"
        )
    return _DTYPES[name]


class ModelRunner:
    def __init__(self, model_path: str | Path, config: RunnerConfig = RunnerConfig(), tp: TPGroup = SINGLE) -> None:
        self.config = config
        self.tp = tp
        # Under tensor parallelism: this rank's view (its heads, KV heads and MLP share).
        self.model_config = mc = ModelConfig.from_pretrained(model_path).for_rank(tp.rank, tp.size, config.ep_size)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.page_size = config.page_size
        self.max_context_len = config.max_context_len or mc.max_position_embeddings
        self.num_heads, self.num_kv_heads, self.head_dim = mc.num_heads, mc.num_kv_heads, mc.head_dim
        self.scaling = mc.head_dim**-0.5
        self.vocab_size = mc.vocab_size

        if config.deterministic:
            self._check_deterministic()
        if config.kv_cache_dtype != "auto":
            self._check_fp8_kv()
        self.model = load_model(mc, self.dtype, self.device, self.max_context_len, tp)
        self.stream_linears = False
        pack = config.cpu_packed_linear and can_pack_linears(self.device, self.dtype)
        if config.deterministic:  # its fp32 blocks stay torch's matmuls, as they were measured
            make_batch_invariant(self.model, pack and self.dtype == torch.bfloat16)
            if tp.size > 1:  # never the shared single-rank group
                tp.ordered_sums = True
        elif pack:
            self.stream_linears = self._stream_linears()
            pack_linears(self.model, stream=self.stream_linears)
        ops = layer_ops_choice.build(self._choose_layer_ops(), self.model, fall_back=config.layer_ops == "auto")
        self.model.use_layer_ops(ops)
        self.layer_ops_name = ops.name

    def _stream_linears(self) -> bool:
        """Whether packed linears keep a second form of their weight for calls of few rows
        (layers.small_rows_form; RunnerConfig.cpu_stream_linears)."""
        if not cpu_kernels.enabled("stream_linears"):
            return False
        if self.config.cpu_stream_linears is not None:
            return self.config.cpu_stream_linears
        linears = [m.weight for m in self.model.modules() if type(m) is torch.nn.Linear]
        if self.dtype == torch.float32 and self.model_config.tie_word_embeddings:
            linears.append(self.model.embed_tokens.weight)  # fp32 panels of a tied head are a copy too
        copy = sum(w.numel() * w.element_size() for w in linears)
        return copy <= STREAM_COPY_MAX_GIB * 2**30

    def _check_deterministic(self) -> None:
        """Deterministic mode runs on the CPU kernels (norms and attention reduce one row at a time
        in a fixed order there); refused at start-up wherever they cannot carry the model."""
        mc = self.model_config
        if self.device.type != "cpu":
            raise ValueError("deterministic mode runs on CPU in this release: on CUDA it needs batch-invariant "
                             "GEMM and attention kernels (docs/engine.md, \"Deterministic mode\")")
        if self.config.layer_ops not in ("auto", "cpu-kernels"):
            raise ValueError(f"deterministic mode computes norms with the CPU kernels, not layer_ops="
                             f"{self.config.layer_ops}")
        if mc.num_experts:
            raise ValueError("deterministic mode does not cover mixture-of-experts models yet: an expert's "
                             "matmuls take as many rows as tokens were routed to it")
        if not cpu_kernels.available():
            raise ValueError(f"deterministic mode needs the CPU kernels: {cpu_kernels.unavailable_reason()}")
        if not cpu_kernels.supports_layer_ops(mc.hidden_size, mc.mlp_width_gcd, mc.head_dim, self.dtype):
            raise ValueError("deterministic mode needs the CPU layer ops, which do not handle this model's shapes "
                             "(hidden and intermediate sizes multiples of 16, head_dim of 32)")
        if not cpu_kernels.supports(mc.head_dim, mc.num_heads, mc.num_kv_heads, self.dtype):
            raise ValueError(f"deterministic mode needs the CPU extend-attention kernel, which does not handle "
                             f"head_dim {mc.head_dim} with {mc.num_heads} heads over {mc.num_kv_heads} kv heads")

    def _check_fp8_kv(self) -> None:
        """An fp8 KV pool is read by the torch backend's gather-and-upcast attention (CPU);
        refused where that is not what would run."""
        if self.device.type != "cpu":
            raise ValueError(f"kv_cache_dtype={self.config.kv_cache_dtype} runs on CPU in this release: on CUDA it "
                             "needs FlashInfer's fp8-KV kernels wired in (docs/engine.md, \"FP8 KV cache\")")
        if self.config.deterministic:
            raise ValueError("deterministic mode reads the KV through the extend kernel, which takes no fp8 KV")

    def _choose_layer_ops(self) -> str:
        mc = self.model_config
        if self.config.deterministic:  # checked by _check_deterministic, whatever the CPU plan prefers
            return "cpu-kernels"
        cpu_ok = (self.device.type == "cpu" and cpu_kernels.enabled("layer_ops")
                  and cpu_kernels.supports_layer_ops(mc.hidden_size, mc.mlp_width_gcd, mc.head_dim, self.dtype))
        return layer_ops_choice.choose(self.config.layer_ops, self.device.type, self.dtype, mc.head_dim,
                                flashinfer_installed(), cpu_ok)

    @classmethod
    def load(cls, model_path: str | Path, config: RunnerConfig = RunnerConfig()) -> ModelRunner:
        runner = cls(model_path, config)
        runner.attach(runner.size_kv_memory())
        return runner

    def weight_bytes(self) -> int:
        # Packed linears keep their weights as buffers, so count both.
        return sum(t.numel() * t.element_size() for t in [*self.model.parameters(), *self.model.buffers()])

    def plans_cuda_graphs(self) -> bool:
        """Whether `attach` will capture CUDA graphs; known before the pool is sized, since the
        graphs keep memory the pool must leave free. FlashInfer is the backend with graph hooks."""
        if self.device.type != "cuda" or self.config.disable_cuda_graph:
            return False
        if self.model_config.num_experts:  # the experts' grouping reads counts on the host (models/moe.py)
            return False
        chosen = choose_backend(self.config.attention_backend, "cuda", self.dtype, self.head_dim,
                                flashinfer_installed())
        return chosen == "flashinfer"

    def size_kv_memory(self) -> KVMemory:
        """KV memory sized for this model on this device (kvcache/kv_memory.py), around what
        the CUDA graphs will hold (runner/graph_memory.py). Tensor-parallel ranks agree on the
        smallest: they schedule identically, so their pools must hold the same pages."""
        graphs = 0
        if self.plans_cuda_graphs():
            graphs = graph_memory(self.model_config, self.config, self.dtype, self.max_context_len).total
        scales = self.model.kv_scales
        if not scales.unit and self.config.kv_cache_dtype == "auto":
            log.info("the checkpoint's fp8 KV scales are unused: the KV cache stores %s", self.dtype)
        return build_kv_memory(self.model_config, self.config, self.dtype, self.device, self.weight_bytes(),
                               self.max_context_len, graphs, agree=self.tp.min_int, scales=scales)

    def attach(self, memory: KVMemory) -> None:
        """Use `memory` for every forward; builds the attention backend (and CUDA graphs) over it."""
        self.memory = memory
        self.req_to_token_pool = memory.req_table
        self.kv_pool = memory.kv_pool
        config, mc = self.config, self.model_config
        self.attn_backend = create_backend(config.attention_backend, self)
        # The overlap loop's future ids live here, not in the scheduler: graph replays resolve
        # and store them inside the graph (runner/graph_inputs.py).
        self.future_map = FutureMap(config.max_running_requests, self.device)
        self.graph_runner = None
        if self.plans_cuda_graphs():  # decided once: the pool was sized around the graphs
            assert self.attn_backend.supports_cuda_graph  # invariant: plans_cuda_graphs() asked the backend
            from tandem.engine.runner.cuda_graph_runner import CudaGraphRunner

            self.graph_runner = CudaGraphRunner(self, config.graph_max_bs)
        if self.device.type == "cuda":
            self.warm_up()
        log.info(
            "model runner: %s %s on %s, KV pool %d tokens (page %d), backend %s, layer ops %s%s",
            mc.architecture, self.dtype, self.device, self.kv_pool.capacity_tokens,
            self.page_size, type(self.attn_backend).__name__, self.layer_ops_name,
            ", small batches stream the linears (fp32 in panels)" if self.stream_linears else "",
        )

    @torch.inference_mode()
    def warm_up(self) -> None:
        """One forward of each extend kind (no cached prefix: FlashInfer's ragged kernel; a prefix:
        its paged one), run by `attach` on CUDA. FlashInfer builds (JIT) each kernel on first use,
        and one that cannot build must fail the start-up, not every request's prefill. Decode is
        warmed by the graph capture. The batches use request row 0 and KV slot 0 only: page 0 is
        reserved as the padding target, so nothing live is read or written."""
        slot0 = torch.zeros(1, dtype=torch.int64)
        for prefix in (0, 1):
            self.forward(ForwardBatch.build(ForwardMode.EXTEND, [0], [0], [prefix], [1], slot0, self.device))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Logits (batch, vocab) in fp32 for the last new token of each request.

        Under CUDA graphs this is a view of the graph's static output, valid until the next
        forward: the scheduler samples from it at once; a caller that keeps logits across
        forwards clones them (a copy per step would cost bandwidth the decode roofline counts)."""
        if self.graph_runner is not None and self.graph_runner.can_run(batch):
            return self.graph_runner.replay(batch)
        self.write_decode_cells(batch)
        self.attn_backend.init_forward_metadata(batch)
        return self.model(batch, self.attn_backend)

    def write_decode_cells(self, batch: ForwardBatch) -> None:
        """The device's table cells of the batch's decode tokens, where the host keeps a mirror:
        the scheduler writes only the mirror for them (ReqToTokenPool.write_decode_cells). Extend
        tokens' cells were written by the scheduler on both; a MIXED batch's decodes are its tail."""
        pool = self.req_to_token_pool
        n = batch.batch_size - batch.num_extend_reqs
        if not pool.mirrored or n == 0:  # an EXTEND batch has no decode rows
            return
        rows, pos, locs = batch.req_pool_indices, batch.positions, batch.out_cache_loc
        if n != batch.batch_size:
            rows, pos, locs = rows[-n:], pos[-n:], locs[-n:]
        pool.req_to_token[rows, pos] = locs.to(pool.req_to_token.dtype)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, sb: SamplingBatch, positions: torch.Tensor) -> SampleOutput:
        return sample(logits, sb, positions)
