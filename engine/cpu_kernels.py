"""Optional fused CPU kernels, compiled from csrc/ on first use.

    csrc/paged_attention_cpu.cpp  paged decode attention   \
    csrc/extend_attention_cpu.cpp paged extend attention    \
    csrc/layer_ops_cpu.cpp        norm, SiLU*mul, RoPE       --(cpp_extension.load, ninja)--> one .so
    csrc/sampling_cpu.cpp         seeded sampling, argmax   /
    csrc/vec16.h                  their 16-lane vector layer
        registers torch.ops.tandem_cpu.*

The build lives in $TANDEM_HOME/torch_extensions/<name>-<key>, where the key
hashes the source, the compile flags, the torch version and the CPU's feature
flags: an edited source or a different CPU (the build uses -march=native) gets
a fresh build, an unchanged one is reused across processes in well under a
second.

`available()` never raises. It is False, with the reason logged once, when
TANDEM_DISABLE_CPU_KERNELS=1, on a non-x86 CPU, or when the build fails (no
compiler, no ninja, no OpenMP); callers then keep their pure-torch path.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = ("paged_attention_cpu.cpp", "extend_attention_cpu.cpp", "layer_ops_cpu.cpp", "sampling_cpu.cpp")
_HEADERS = tuple(sorted(p.name for p in _CSRC.glob("*.h")))  # all of them feed the build key
_CFLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]
# head_dim values the kernels are instantiated for (csrc/dispatch.h)
SUPPORTED_HEAD_DIMS = frozenset({32, 64, 96, 128, 256})
SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16})
MAX_GROUP = 16  # query heads per kv head

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "reason": str; filled once by _load()


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _build_dir(key: str) -> Path:
    home = Path(os.environ.get("TANDEM_HOME", "~/.cache/tandem")).expanduser()
    return home / "torch_extensions" / f"tandem_cpu-{key}"


def _load() -> None:
    if os.environ.get("TANDEM_DISABLE_CPU_KERNELS", "") not in ("", "0"):
        raise RuntimeError("disabled by TANDEM_DISABLE_CPU_KERNELS")
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise RuntimeError(f"built for x86-64 only, this CPU is {platform.machine()}")
    from torch.utils import cpp_extension

    texts = [(_CSRC / f).read_bytes() for f in (*_SOURCES, *_HEADERS)]
    key = hashlib.sha256(
        b"\0".join([*texts, " ".join(_CFLAGS).encode(), torch.__version__.encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    build_dir = _build_dir(key)
    build_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    # is_python_module=False: the .so only registers ops with the dispatcher (no pybind11).
    cpp_extension.load(
        name=f"tandem_cpu_{key}",
        sources=[str(_CSRC / f) for f in _SOURCES],
        extra_cflags=_CFLAGS,
        extra_ldflags=_LDFLAGS,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    torch.ops.tandem_cpu.paged_decode_attention  # noqa: B018  (raises if registration failed)
    torch.ops.tandem_cpu.paged_extend_attention  # noqa: B018
    torch.ops.tandem_cpu.rope_qk  # noqa: B018
    torch.ops.tandem_cpu.store_kv  # noqa: B018
    torch.ops.tandem_cpu.gumbel_argmax  # noqa: B018
    torch.ops.tandem_cpu.greedy_argmax  # noqa: B018
    log.info("CPU kernels ready in %.1fs (%s)", time.perf_counter() - t0, build_dir)


def available() -> bool:
    """True when the fused CPU kernels are built and loaded. Never raises."""
    if "ok" not in _state:
        with _lock:
            if "ok" not in _state:
                try:
                    _load()
                    _state.update(ok=True, reason="")
                except Exception as e:  # a missing compiler or ninja must not take the engine down
                    reason = f"{type(e).__name__}: {e}".strip().splitlines()
                    _state.update(ok=False, reason=reason[-1] if reason else type(e).__name__)
                    log.warning(
                        "CPU kernels unavailable, using the torch fallback: %s", _state["reason"]
                    )
    return bool(_state["ok"])


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    available()
    return str(_state["reason"])


def supports(head_dim: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> bool:
    """Whether the paged decode and extend attention handle this shape and dtype (assumes available())."""
    return (
        head_dim in SUPPORTED_HEAD_DIMS
        and dtype in SUPPORTED_DTYPES
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int = 0,
) -> torch.Tensor:
    """Decode attention of one new token per request over its paged KV.

    q (batch, heads, dim); k/v_buffer (slots, kv_heads, dim) in q's dtype;
    req_to_token (rows, max_ctx) int32; req_pool_indices (batch,) int64;
    seq_lens (batch,) int32, counting the new token. Request b attends to the
    slots req_to_token[req_pool_indices[b], :seq_lens[b]]. Returns out
    (batch, heads, dim) in q's dtype. num_splits 0 = choose by thread count.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    torch.ops.tandem_cpu.paged_decode_attention(
        out, q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, float(scale), num_splits
    )
    return out


def paged_extend_attention(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    q_starts: torch.Tensor,
    scale: float,
    use_amx: bool = True,
) -> torch.Tensor:
    """Causal attention of every extend request's new tokens over its paged KV, in one call.

    q (tokens, heads, dim); k/v_buffer (slots, kv_heads, dim) in q's dtype, already
    holding the new tokens' K/V; req_to_token (rows, max_ctx) int32; req_pool_indices
    (batch,) int64; prefix_lens, extend_lens, q_starts (batch,) int32. Request b's queries
    are q[q_starts[b] : q_starts[b] + extend_lens[b]]; its new token j sees the slots
    req_to_token[row, : prefix_lens[b] + j + 1]. Returns (tokens, heads, dim) in q's dtype;
    rows of q no request covers are left unwritten. use_amx: bf16 products on AMX tiles
    where the CPU has them (p rounded to bf16, as torch's bf16 SDPA does); False keeps
    the fp32 FMA path.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    torch.ops.tandem_cpu.paged_extend_attention(
        out, q, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, q_starts, float(scale),
        use_amx,
    )
    return out


# ---- decoder-layer ops (csrc/layer_ops_cpu.cpp); callers check supports_layer_ops() once ----


def supports_layer_ops(hidden: int, intermediate: int, head_dim: int, dtype: torch.dtype) -> bool:
    """Whether the fused norm / SiLU*mul / RoPE ops handle this model (assumes available())."""
    return dtype in SUPPORTED_DTYPES and hidden % 16 == 0 and intermediate % 16 == 0 and head_dim % 32 == 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rmsnorm(x) over the last dim of a 2-D x, into a new tensor."""
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.ops.tandem_cpu.rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = weight * rmsnorm(residual)."""
    torch.ops.tandem_cpu.fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    torch.ops.tandem_cpu.silu_and_mul(out, gate_up)
    return out


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v in one call: (slots, kv_heads, dim) buffers,
    (tokens, kv_heads, dim) k/v of their dtype (token rows may be strided), int64 loc."""
    torch.ops.tandem_cpu.store_kv(k_buffer, v_buffer, loc, k, v)


_EMPTY = torch.empty(0)


def rope_qk(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
    num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float,
) -> None:
    """In place on the q and k heads of qkv (tokens, (hq + 2 hkv) * dim): optional
    per-head RMSNorm (Qwen3), then neox RoPE from (max_positions, dim) tables in fp32 or qkv's dtype."""
    torch.ops.tandem_cpu.rope_qk(
        qkv, positions, cos, sin,
        _EMPTY if q_norm_weight is None else q_norm_weight,
        _EMPTY if k_norm_weight is None else k_norm_weight,
        num_q_heads, num_kv_heads, head_dim, eps,
    )


def gumbel_argmax(
    logits: torch.Tensor,
    inv_temp: torch.Tensor,
    seeds: torch.Tensor,
    positions: torch.Tensor,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    min_p: torch.Tensor | None = None,
) -> torch.Tensor:
    """argmax_v(logits * inv_temp + G(seed, position, v)) per row, with sampler.py's hashed
    Gumbel noise computed in the same pass, over the tokens that survive top-k / top-p /
    min-p of the tempered distribution (bisected thresholds, no vocab sort). A filter
    left None is off for every row (csrc/sampling_cpu.cpp)."""
    b, vocab = logits.shape
    f32 = lambda t, off: torch.full((b,), off) if t is None else t.float().contiguous().view(-1)  # noqa: E731
    i64 = lambda t: t.to(torch.int64).contiguous().view(-1)  # noqa: E731
    k = torch.full((b,), vocab, dtype=torch.int64) if top_k is None else i64(top_k)
    return torch.ops.tandem_cpu.gumbel_argmax(
        logits.float().contiguous(), f32(inv_temp, 1.0), k, f32(top_p, 1.0), f32(min_p, 0.0), i64(seeds), i64(positions)
    )


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the first index of the maximum (what torch.argmax returns), ~5-10x faster."""
    return torch.ops.tandem_cpu.greedy_argmax(logits.float().contiguous())
