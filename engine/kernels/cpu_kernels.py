"""The fused CPU kernels (csrc/), as torch-shaped Python functions.

    csrc/paged_attention_cpu.cpp  paged decode attention   \
    csrc/extend_attention_cpu.cpp paged extend attention    \
    csrc/layer_ops_cpu.cpp        norm, SiLU*mul, RoPE, KV   --(cpu_build.py, one .so per level)-->
    csrc/sampling_cpu.cpp         seeded sampling, argmax   /      torch.ops.tandem_cpu_<level>.*
    csrc/expert_gemm_cpu.cpp      MoE experts at decode    /
    csrc/panel_linear_cpu.cpp     fp32 linears, few rows  /
    csrc/decode_layer_cpu.cpp     a decoder layer of a decode step, in one call (the above, called directly)
    csrc/vec16.h                  their 16-lane vector layer (AVX-512, AVX2 or plain lanes)

Which build runs, and which ops use it, is cpu_plan.current()'s decision for this CPU.
Callers ask `enabled(op)` once, at construction, and keep their torch path otherwise.
`forced(level)` switches every op to another build the CPU executes (the tests run each
level against the same references).

`available()` never raises. It is False, with the reason logged once, when the plan
has no level (TANDEM_DISABLE_CPU_KERNELS=1) or the build fails (no compiler, no ninja,
no OpenMP).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator
from typing import Any

import torch

from tandem.engine.kernels import cpu_build, cpu_plan

log = logging.getLogger(__name__)

# head_dim values the kernels are instantiated for (csrc/dispatch.h)
SUPPORTED_HEAD_DIMS = frozenset({32, 64, 96, 128, 256})
SUPPORTED_DTYPES = frozenset({torch.float32, torch.bfloat16})
MAX_GROUP = 16  # query heads per kv head

_lock = threading.Lock()
_forced: list[str] = []  # the level forced(...) set, innermost last
_loaded: dict[str, object] = {}  # level -> torch.ops namespace, or "" when it failed
_reasons: dict[str, str] = {}  # level -> why it failed


def active_level() -> str | None:
    return _forced[-1] if _forced else cpu_plan.current().level


def _ns(level: str | None) -> object | None:
    if level is None:
        return None
    if level not in _loaded:
        with _lock:
            if level not in _loaded:
                try:
                    _loaded[level] = getattr(torch.ops, cpu_build.load(level))
                except Exception as e:  # a missing compiler or ninja must not take the engine down
                    _reasons[level] = _first_error(e)
                    _loaded[level] = ""
                    log.warning("CPU kernels (%s) unavailable, using the torch path: %s", level, _reasons[level])
    return _loaded[level] or None


def _first_error(e: BaseException) -> str:
    """The compiler's first error line, else the exception's last line: a build log ends in
    "ninja: build stopped", which says nothing."""
    lines = f"{type(e).__name__}: {e}".strip().splitlines()
    errors = [ln.strip() for ln in lines if "error:" in ln]
    return (errors or lines or [type(e).__name__])[0 if errors else -1]


def available() -> bool:
    """True when the active level's kernels are built and loaded. Never raises."""
    return _ns(active_level()) is not None


def unavailable_reason() -> str:
    """Why `available()` is False ('' when it is True)."""
    level = active_level()
    if level is None:
        return "disabled by TANDEM_DISABLE_CPU_KERNELS"
    return "" if available() else _reasons.get(level, "")


def enabled(op: str) -> bool:
    """Whether `op` (one of cpu_plan.OPS) runs the kernels: built, and chosen for this CPU."""
    if op not in cpu_plan.OPS:
        raise ValueError(f"unknown kernel op {op!r}")
    return available() and (bool(_forced) or op in cpu_plan.current().ops)


@contextlib.contextmanager
def forced(level: str) -> Iterator[None]:
    """Every op on `level`'s build (which this CPU must execute) inside the block."""
    if level not in cpu_plan.levels_supported(cpu_plan.read_cpu_flags()):  # the CPU's own, uncapped
        raise ValueError(f"this CPU does not execute the {level} kernels")
    _forced.append(level)
    try:
        yield
    finally:
        _forced.pop()


def _ops() -> Any:  # the level's torch.ops namespace
    ns = _ns(active_level())
    if ns is None:
        raise RuntimeError(f"CPU kernels unavailable: {unavailable_reason()}")
    return ns


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
    _ops().paged_decode_attention(
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
    when the build has them (the amx level; p rounded to bf16, as torch's bf16 SDPA does);
    False keeps the fp32 FMA path.
    """
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _ops().paged_extend_attention(
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
    _ops().rms_norm(out, x, weight, eps)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: residual += x, then x = weight * rmsnorm(residual)."""
    _ops().fused_add_rms_norm(x, residual, weight, eps)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    out = torch.empty((gate_up.shape[0], gate_up.shape[1] // 2), dtype=gate_up.dtype)
    _ops().silu_and_mul(out, gate_up)
    return out


def store_kv(k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """k_buffer[loc] = k and v_buffer[loc] = v in one call: (slots, kv_heads, dim) buffers,
    (tokens, kv_heads, dim) k/v of their dtype (token rows may be strided), int64 loc."""
    _ops().store_kv(k_buffer, v_buffer, loc, k, v)


def expert_gemm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(S, N): row r times its expert's weight w[e] (E, N, K) as stored, for x (S, K) sorted by
    expert with cumulative int32 counts `offsets` (E,); rows past offsets[-1] unwritten."""
    out = torch.empty((x.shape[0], w.shape[1]), dtype=x.dtype)
    _ops().expert_gemm(out, x, w, offsets)
    return out


_ONE_EXPERT: dict[int, torch.Tensor] = {}


def stream_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) for a few rows (x (M, K) contiguous, w (N, K) as stored, K a multiple of
    16): the experts' kernel with one expert, which streams w once at close to the machine's read
    bandwidth, where oneDNN's small-M GEMM reads it at a third to a half of that
    (bench/small_m_gemm.py --cpu)."""
    m = x.shape[0]
    offsets = _ONE_EXPERT.get(m)
    if offsets is None:
        offsets = _ONE_EXPERT.setdefault(m, torch.tensor([m], dtype=torch.int32))
    out = expert_gemm(x, w.unsqueeze(0), offsets)
    return out if bias is None else out.add_(bias)


PANEL = 32  # output features per panel (csrc/panel_linear_cpu.cpp)


def pack_panels(w: torch.Tensor) -> torch.Tensor:
    """w (N, K) fp32 as panel_linear reads it: (ceil(N / 32), K, 32), panel p holding output features
    [32p, 32p + 32) with their 32 weights of each input feature side by side, zeros past N."""
    n, k = w.shape
    pad = -n % PANEL
    padded = torch.nn.functional.pad(w.detach(), (0, 0, 0, pad)) if pad else w.detach()
    return padded.reshape(-1, PANEL, k).transpose(1, 2).contiguous()


def panel_linear(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T (+ bias) in fp32 for x (M, K) with contiguous rows, w given as pack_panels(w) of its
    `n` output features. With the weights cold, as a decode step has them, it ran the smollm2 step
    1.04-1.35x faster than oneDNN's packed fp32 GEMM at 1-64 rows (docs/benchmarks.md, "fp32
    linears in panels"); oneDNN wins at a few hundred rows."""
    out = torch.empty((x.shape[0], n), dtype=torch.float32)
    _ops().panel_linear(out, x, panels, bias)
    return out


_EMPTY = torch.empty(0)


def decode_layer(
    x: torch.Tensor, residual: torch.Tensor, first: bool, weights: list[torch.Tensor], qkv_bias: torch.Tensor | None,
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor,
    loc: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor,
    num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float, scale: float,
) -> torch.Tensor:
    """One decoder layer of a decode step (csrc/decode_layer_cpu.cpp): the layer's norms, small-rows
    linears, RoPE, KV store and paged decode attention, the same kernels in the same order as its
    modules call them. x (tokens, hidden) and residual (its shape) are updated in place (first: the
    residual is set from x); weights = [ln1, ln2, qkv, o, gate_up, down, q_norm, k_norm], the
    linears in their small-rows form (fp32 pack_panels, or a bf16 weight as stored), q_norm/k_norm
    empty without qk-norm. Returns the layer's output."""
    return _ops().decode_layer(
        x, residual, first, weights, qkv_bias, positions, cos, sin, k_buffer, v_buffer, loc, req_to_token, rows,
        seq_lens, num_q_heads, num_kv_heads, head_dim, eps, scale,
    )


def rope_qk(
    qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
    num_q_heads: int, num_kv_heads: int, head_dim: int, eps: float,
) -> None:
    """In place on the q and k heads of qkv (tokens, (hq + 2 hkv) * dim): optional
    per-head RMSNorm (Qwen3), then neox RoPE from (max_positions, dim) tables in fp32 or qkv's dtype."""
    _ops().rope_qk(
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
    return _ops().gumbel_argmax(
        logits.float().contiguous(), f32(inv_temp, 1.0), k, f32(top_p, 1.0), f32(min_p, 0.0), i64(seeds), i64(positions)
    )


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the first index of the maximum (what torch.argmax returns), ~5-10x faster."""
    return _ops().greedy_argmax(logits.float().contiguous())
