"""EngineConfig: every knob of the engine, under SGLang's server-arg names.

One frozen dataclass feeds `Engine(**config)`, the CLI flags and the servers.
"auto" values are resolved once, at start-up, with dataclasses.replace.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from tandem.engine.model_config import RunnerConfig
from tandem.protocol.kv_events import KVEventsConfig
from tandem.worker_contract import EngineYaml

POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")
LOAD_BALANCE_METHODS = ("round_robin", "total_requests", "total_tokens", "follow_bootstrap_room")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2")
HICACHE_WRITE_POLICIES = ("write_through", "write_back")  # kvcache/host_tier.py


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"
    dtype: str = "auto"
    device: str = "auto"
    page_size: int = 1
    chunked_prefill_size: int | None = None  # None: by device (default_chunked_prefill_size); <= 0 disables
    max_prefill_tokens: int = 8192
    max_total_tokens: int | None = None
    max_running_requests: int = 256
    mem_fraction_static: float = 0.5
    schedule_policy: str = "fcfs"
    schedule_conservativeness: float = 1.0
    # None: overlap on CUDA, normal loop on CPU, where overlap measured ~8% slower
    # (the forward thread waits on the GIL; docs/benchmarks.md, "Overlap vs normal loop").
    disable_overlap_schedule: bool | None = None
    enable_mixed_chunk: bool = False
    disable_radix_cache: bool = False
    # A host-memory tier under the radix cache (kvcache/host_tier.py; SGLang's HiCache flags): its
    # size is hicache_size GiB when set, else hicache_ratio times the device pool; write_through
    # copies a page to the host when the cache takes it, write_back when the device evicts it.
    # KV events for an external router (kvcache/kv_events.py): vLLM's --kv-events-config JSON, e.g.
    # {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}.
    kv_events_config: str | None = None
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: float = 0.0
    hicache_write_policy: str = "write_through"
    # A disk tier under the host tier (kvcache/disk_tier.py; SGLang's --hicache-storage-backend):
    # "file" keeps pages the host drops in hicache_storage_dir ($TANDEM_HOME/kv-disk when unset),
    # at most hicache_storage_size GiB, and a restarted worker on the same model reads them.
    hicache_storage_backend: str | None = None
    hicache_storage_dir: str | None = None
    hicache_storage_size: float = 16.0
    enable_priority_scheduling: bool = False
    priority_scheduling_preemption_threshold: int = 10
    dp_size: int = 1
    # Tensor parallelism (engine/parallel/, docs/tp.md): tp_size processes per DP rank, one GPU
    # each, rendezvous at dist_init_addr ("host:port"; DP rank r uses port + r). None: a free
    # loopback port, for ranks that all run on this machine.
    tp_size: int = 1
    # Expert parallelism (MoE models, engine/parallel/experts.py): 1, or tp_size to give each TP
    # rank whole experts instead of a share of every expert.
    ep_size: int = 1
    dist_init_addr: str | None = None
    debug_tp_digest: bool = False  # ranks compare a digest of every batch (parallel/digest.py)
    base_gpu_id: int = 0  # CUDA: DP rank r, TP rank t runs on GPU base_gpu_id + r * tp_size + t (device_map.py)
    load_balance_method: str = "round_robin"
    attention_backend: str = "auto"
    layer_ops: str = "auto"  # norms, RoPE, SiLU*mul: auto | torch | cpu-kernels | flashinfer (models/layer_ops.py)
    decode_tensor_cores: bool | None = None  # FlashInfer decode kernel; None: by heads per KV head
    decode_split_kv: bool | None = None  # FlashInfer's split-KV decode; None: off once the batch fills the GPU
    # CPU: calls of few rows run each linear from a second copy of its weight through the CPU kernels
    # (models/layers.py: bf16 up to 4 rows, fp32 up to 64 in panels); None: where the copies come to
    # at most 2 GiB.
    cpu_stream_linears: bool | None = None
    fused_rope_kv: bool | None = None  # RoPE + K/V store in one Triton launch; None: on CUDA
    disable_cuda_graph: bool = False
    # Bit-identical tokens for a request whatever its batch, cache hits, chunks, loop or PD role
    # (SGLang's --enable-deterministic-inference; docs/engine.md, "Deterministic mode").
    deterministic: bool = False
    cuda_graph_max_bs: int | None = None  # None: every decode batch up to max_running_requests
    max_context_len: int | None = None
    # How the KV pool stores K and V (SGLang's --kv-cache-dtype): "auto" (the model's dtype), or
    # fp8_e4m3 / fp8_e5m2, a byte per value (kvcache/kv_memory.py: kv_storage_dtype).
    kv_cache_dtype: str = "auto"
    waiting_timeout: float | None = None  # seconds a request may wait before it is aborted
    running_timeout: float | None = None  # seconds a request may run before it is aborted
    # Congestion control of the KV budget (SGLang's new_token_ratio).
    init_new_token_ratio: float = 0.7
    min_new_token_ratio_factor: float = 0.14
    new_token_ratio_decay_steps: int = 600
    retract_decode_steps: int = 20
    clip_max_new_tokens: int = 4096
    seed: int = 0
    log_level: str = "warning"
    # Prefill/decode disaggregation (prefill/, decode/, docs/pd.md). The server sets the
    # bootstrap address from --host/--bootstrap-port; the rest are flags and engine YAML keys.
    pd_bootstrap_host: str = "127.0.0.1"
    pd_bootstrap_port: int = 8998
    pd_prefill_peers: str | None = None  # decode: "host:port,..." handshaken at start (readiness)
    pd_heartbeat_interval: float = 2.0
    pd_heartbeat_timeout: float = 10.0  # a silent peer is dead after this
    pd_bootstrap_timeout: float = 30.0  # a request waits this long for its peer's handshake/pages
    pd_prealloc_timeout: float = 300.0  # decode: for room in a full pool
    pd_transfer_timeout: float = 60.0  # decode: from pages sent to the last KV chunk landing
    pd_local_prefill_threshold: int = 32  # decode prefills itself at most this many uncached tokens
    disable_pd_decode_prefix_reuse: bool = False
    # Structured output (engine/grammar/): the library that compiles constraints, how long a
    # request may wait for its grammar (and a compile may run before its process is killed),
    # how many compiled grammars are kept, and what one request's grammar may cost.
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout: float = 60.0
    grammar_cache_size: int = 256
    grammar_cache_bytes: int = 256 * 2**20  # all compiled grammars kept, by their memory
    grammar_max_bytes: int = 16 * 2**20  # one grammar: larger is refused (a 400)
    grammar_compile_workers: int = 2  # compile processes, started when first needed
    grammar_compile_queue: int = 16  # compiles waiting for a process; past it a request gets a 429
    # A request's matcher may take this many seconds of CPU per token, on average over its
    # last grammar_matcher_window tokens (engine/grammar/matcher_budget.py); past it, a 400.
    grammar_matcher_budget: float = 0.005  # ~50x a JSON schema's cost on a 49k vocabulary (0.1 ms)
    grammar_matcher_window: int = 32

    def __post_init__(self) -> None:
        if self.schedule_policy not in POLICIES:
            raise ValueError(f"schedule_policy must be one of {POLICIES}")
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(f"load_balance_method must be one of {LOAD_BALANCE_METHODS}")
        if self.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError("tp_size must be >= 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if not isinstance(self.ep_size, int) or self.ep_size not in (1, self.tp_size):
            raise ValueError(f"ep_size must be 1 or tp_size ({self.tp_size}): expert parallelism runs on the "
                             f"TP group's ranks, got {self.ep_size!r}")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 1024 <= int(port) <= 65535 - self.dp_size:
                raise ValueError(f"dist_init_addr must be host:port with a port in 1024..{65535 - self.dp_size}")
        if self.base_gpu_id < 0:
            raise ValueError("base_gpu_id must be >= 0")
        for f in dataclasses.fields(self):  # every switch: a quoted "false" in an engine YAML would read as true
            value = getattr(self, f.name)
            if str(f.type).startswith("bool") and not isinstance(value, bool) and not (
                    value is None and "None" in str(f.type)):
                allowed = "true, false or null" if "None" in str(f.type) else "true or false"
                raise ValueError(f"{f.name} must be {allowed}, got {value!r}")
        if self.schedule_conservativeness <= 0:
            raise ValueError("schedule_conservativeness must be > 0")
        from tandem.engine.grammar.registry import BACKENDS  # torch-free at import: a dict of factories

        if self.grammar_backend not in BACKENDS:
            raise ValueError(f"grammar_backend must be one of {sorted(BACKENDS)}")
        if not self.grammar_compile_timeout > 0 or self.grammar_cache_size < 1:
            raise ValueError("grammar_compile_timeout must be > 0 and grammar_cache_size >= 1")
        if not 1 <= self.grammar_max_bytes <= self.grammar_cache_bytes:
            raise ValueError("grammar_max_bytes must be >= 1 and at most grammar_cache_bytes")
        if self.grammar_compile_workers < 1 or self.grammar_compile_queue < 0:
            raise ValueError("grammar_compile_workers must be >= 1 and grammar_compile_queue >= 0")
        if not self.grammar_matcher_budget > 0 or self.grammar_matcher_window < 1:
            raise ValueError("grammar_matcher_budget must be > 0 and grammar_matcher_window >= 1")
        if self.hicache_write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}, "
                             f"got {self.hicache_write_policy!r}")
        if self.enable_hierarchical_cache:
            if self.disable_radix_cache:
                raise ValueError("enable_hierarchical_cache is a tier of the radix cache: drop disable_radix_cache")
        events = KVEventsConfig.parse(self.kv_events_config)
        if events.enabled and self.disable_radix_cache:
            raise ValueError("KV events describe the radix cache: drop disable_radix_cache to publish them")
        if self.hicache_storage_backend not in (None, "file"):
            raise ValueError(f"hicache_storage_backend must be file (or unset), got {self.hicache_storage_backend!r}")
        if self.hicache_storage_backend and not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend is a tier under the host tier: add enable_hierarchical_cache")
        if not 0 < self.hicache_storage_size <= 1 << 20:
            raise ValueError("hicache_storage_size must be in (0, 2^20] GiB")
        if not (0 < self.hicache_ratio <= 1000 and 0 <= self.hicache_size <= 1 << 20):
            raise ValueError("hicache_ratio must be in (0, 1000] and hicache_size in [0, 2^20] GiB")
        if self.chunked_prefill_size is not None and 0 < self.chunked_prefill_size < self.page_size:
            raise ValueError("chunked_prefill_size must be at least one page")

    @functools.cached_property
    def chunk_size(self) -> int | None:
        """The prefill chunk in tokens (None: no chunking); `None` in the config picks by device."""
        size = self.chunked_prefill_size
        if size is None:
            from tandem.engine.runner.model_runner import resolve_device

            size = default_chunked_prefill_size(resolve_device(self.device))
        return size if size > 0 else None

    @property
    def enable_overlap(self) -> bool:
        if self.disable_overlap_schedule is not None:
            return not self.disable_overlap_schedule
        from tandem.engine.runner.model_runner import resolve_device  # here: reading a config needs no torch

        return resolve_device(self.device).type == "cuda"

    def runner_config(self) -> RunnerConfig:
        return RunnerConfig(
            dtype=self.dtype, device=self.device, page_size=self.page_size,
            max_total_tokens=self.max_total_tokens, mem_fraction_static=self.mem_fraction_static,
            max_running_requests=self.max_running_requests, max_context_len=self.max_context_len,
            attention_backend=self.attention_backend, layer_ops=self.layer_ops,
            decode_tensor_cores=self.decode_tensor_cores, decode_split_kv=self.decode_split_kv,
            fused_rope_kv=self.fused_rope_kv, deterministic=self.deterministic, ep_size=self.ep_size,
            cpu_stream_linears=self.cpu_stream_linears,
            kv_cache_dtype=self.kv_cache_dtype,
            disable_cuda_graph=self.disable_cuda_graph, cuda_graph_max_bs=self.cuda_graph_max_bs,
            max_forward_tokens=max(self.max_prefill_tokens, self.chunk_size or 0),
        )

    @classmethod
    def from_kwargs(cls, **kw: object) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(kw) - names
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        return cls(**kw)  # type: ignore[arg-type]

    @classmethod
    def from_engine_yaml(cls, text: str, **overrides: object) -> tuple[EngineConfig, EngineYaml]:
        """The engine options of a worker-contract engine.yaml (what the operator mounts), with
        command-line `overrides` on top; the contract's own keys come back beside them."""
        doc = EngineYaml.parse(text)
        return cls.from_kwargs(**{"tp_size": doc.tp_size, **doc.engine_args, **overrides}), doc


def default_chunked_prefill_size(device: Any, total_memory: int | None = None) -> int:
    """2048 on CPU. On CUDA, by device memory as SGLang sizes it: a bigger chunk amortises
    each forward's fixed costs over more tokens (2048-token chunks ran an 8x2048 prefill at
    half of HF's one-forward speed on an H100), and its activations must still fit."""
    if getattr(device, "type", device) != "cuda":
        return 2048
    if total_memory is None:
        import torch

        total_memory = torch.cuda.get_device_properties(device).total_memory
    gib = total_memory / (1 << 30)
    return 2048 if gib < 35 else 4096 if gib < 60 else 8192
