"""Building blocks shared by the decoder models: norm, MLP, and the CPU's packed linears
(the rotary embedding's table is rotary.py, shared with the layer ops that apply it).

All operate on flattened tokens: hidden states are (num_tokens, hidden). The norm and MLP
compute through the model's layer ops (layer_ops.py): HF's torch chain by default (fp32
logits match HF to ~1e-5), or the device's fused kernels.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.kernels import cpu_kernels, cpu_plan
from tandem.engine.models.layer_ops import TORCH, LayerOps
from tandem.engine.parallel.group import SINGLE, TPGroup


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it, through the model's
    layer ops (layer_ops.py; the torch chain unless fused ones are chosen)."""

    ops: LayerOps = TORCH

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x). Fused ops update both in place, so x and
        residual must be tensors this forward owns."""
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up fused into one matmul. Under tensor parallelism
    `intermediate` is this rank's share (gate/up column-parallel, down row-parallel) and
    `tp` sums the ranks' partial outputs."""

    ops: LayerOps = TORCH

    def __init__(self, hidden: int, intermediate: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x))))


def row_bucket(n: int) -> int:
    """Rows a CPU matmul is padded to. oneDNN builds (JITs) a kernel per new shape,
    ~2 ms per call for a decode-sized matmul and ~20 ms for a prefill-sized one; a
    batch that shrinks by one request per step would pay it every step. Buckets
    bound the distinct shapes: multiples of 8 up to 64, of 32 up to 512, then 128."""
    step = 8 if n <= 64 else 32 if n <= 512 else 128
    return -(-n // step) * step


def bucketed(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) computed on x padded to row_bucket(rows); returns the real rows."""
    n = x.shape[0]
    m = row_bucket(n)
    if m == n:
        return fn(x)
    return fn(torch.nn.functional.pad(x, (0, 0, 0, m - n)))[:n]


STREAM_ROWS = 4  # bf16: up to this many rows a streamed matmul (stream_linear) beat oneDNN's (smollm2 decode steps)
# fp32, AVX-512 kernels: up to this many rows panel_linear beat oneDNN (smollm2 steps: 1.15x at 64, 0.96x at 128)
PANEL_ROWS = 64
PANEL_ROWS_AVX2 = 8  # fp32, AVX2 kernels (half-panel blocks of 6 rows): 1.26x at 8, 0.83x at 32 (forced AVX2)


def panel_rows() -> int:
    """Rows up to which an fp32 linear runs on its panels, for the kernel level active now."""
    return PANEL_ROWS if cpu_kernels.active_level() in ("avx512", "avx512_bf16", "amx") else PANEL_ROWS_AVX2


class PackedLinear(nn.Module):
    """A bf16 or fp32 nn.Linear whose weight is pre-reordered into oneDNN's blocked layout.

    CPU-only: torch's plain bf16 matmul re-lays-out the weight on every call; packing
    once at load time removes that (measured 1.2-1.7x on the small model's shapes).
    Rows are padded to buckets so oneDNN reuses its compiled kernels (row_bucket).

    With `small` (small_rows_form: a second form of the weight) a call of few rows, a decode step
    or a short prefill, runs through a CPU kernel instead, which keeps the memory streaming where
    oneDNN's small-M GEMM leaves it idle: bf16 streams the weight as stored for at most STREAM_ROWS
    rows (1.5-2x oneDNN there), fp32 its panels for at most panel_rows() (1.04-1.35x the decode
    step with the AVX-512 kernels; docs/benchmarks.md,
    "Small decode batches on CPU" and "fp32 linears in panels"). The price is that second copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, batch_hint: int = 64,
                 small: torch.Tensor | None = None, owns_small: bool = True) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight.detach(), batch_hint))
        self.bias = bias
        if small is not None and owns_small:  # a buffer: the runner counts it in the weights' bytes
            self.register_buffer("small_copy", small, persistent=False)
        self.small = small  # not owned: another module's (a tied bf16 head's is the embedding), counted there
        self.panels = small is not None and small.dim() == 3
        self.small_rows = 0 if small is None else panel_rows() if self.panels else STREAM_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.small_rows:
            if self.panels:
                return cpu_kernels.panel_linear(x.contiguous(), self.small, self.out_features, self.bias)
            return cpu_kernels.stream_linear(x.contiguous(), self.small, self.bias)
        return bucketed(self._mm, x)

    def _mm(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")


def small_rows_form(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight's second form for calls of few rows (PackedLinear), where the CPU kernels take it:
    fp32 in panels (cpu_kernels.pack_panels, a copy), bf16 as stored (stream_linear reads 16 input
    features at a time: the weight itself, no copy)."""
    if not cpu_kernels.enabled("stream_linears"):
        return None
    if weight.dtype == torch.float32:
        return cpu_kernels.pack_panels(weight)
    return weight.detach() if weight.shape[1] % 16 == 0 else None


def can_pack_linears(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN's bf16 reorder raises on a CPU without AVX512 BW/VL/DQ or AVX-NE-CONVERT:
    the CPU plan says whether this one has them. fp32 packs on any CPU oneDNN runs on: torch's
    plain fp32 linear ran at a quarter to an eighth of the packed GEMM's rate at 16-32 rows on
    smollm2's shapes (docs/benchmarks.md, "fp32 on the AVX-512 Xeon, and fp32 linears")."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and cpu_plan.current().pack_bf16_linears)


def pack_linears(model: nn.Module, stream: bool = False) -> int:
    """Replace every nn.Linear (not embeddings / tied heads) by a PackedLinear; with `stream`,
    each keeps a second form of its weight for calls of few rows (PackedLinear, small_rows_form)."""
    # The LM head is the model's to pack (pack_lm_head): it may be tied to the embedding.
    targets = [(n, m) for n, m in model.named_modules() if type(m) is nn.Linear and not n.endswith("lm_head")]
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        small = small_rows_form(mod.weight) if stream else None
        setattr(model.get_submodule(parent_name) if parent_name else model, attr,
                PackedLinear(mod.weight, mod.bias, small=small))
    pack_head = getattr(model, "pack_lm_head", None)
    if pack_head is not None:
        pack_head(stream)
    return len(targets) + (pack_head is not None)
