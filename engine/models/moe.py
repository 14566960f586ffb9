"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top-k experts,
each expert is a SwiGLU MLP, and a token's output is its experts' outputs weighted by the router.

    x (T, H) --router, fp32--> softmax over E experts --top-k--> (T, k) experts and weights
                                                                  [renormalised to sum 1]
    (token, expert) pairs sorted by expert; the experts' SwiGLU MLPs over exactly their pairs
    as a grouped GEMM (models/expert_mlp.py: torch's grouped matmul, a per-expert oneDNN loop,
    or a Triton kernel on CUDA; never a loop over tokens); each pair's output times its weight,
    a token's k pairs summed.

The router runs in fp32 whatever the model's dtype, so that top-k picks what HF's fp32
softmax picks. The combine is HF's (weight in the model's dtype, the k pairs summed at once),
so a bf16 sum rounds where HF's does.

Tensor parallelism: every rank holds every expert's slice of the intermediate features
(gate/up rows and down columns [r*I/T, (r+1)*I/T)) and the whole router; each rank's sum is
a partial of the output, and the dense MLP's all-reduce completes it. No new collective.
With expert parallelism (parallel/experts.py) a rank holds its experts whole instead and
computes only the tokens routed to them; the same all-reduce combines the ranks.

Checkpoint names (loader.py): Qwen3-MoE `mlp.gate` and `mlp.experts.<e>.{gate,up,down}_proj`,
Mixtral `block_sparse_moe.gate` and `block_sparse_moe.experts.<e>.{w1,w3,w2}` (gate, up, down),
or transformers v5's stacked `experts.gate_up_proj` / `experts.down_proj` (one tensor a layer).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.models import expert_mlp
from tandem.engine.models.layer_ops import TORCH, LayerOps
from tandem.engine.parallel.group import SINGLE, TPGroup

# checkpoint name -> (this module's parameter, which part of it: 0 gate rows, 1 up rows, 2 down)
_EXPERT = re.compile(
    r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_ROUTER = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.gate\.weight$")
# transformers v5's own layout (what its in-memory model and GGUF conversion hold): every expert
# of a layer in one 3-D tensor, gate_up_proj (E, 2I, H) and down_proj (E, H, I).
_STACKED = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(gate_up_proj|down_proj)$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}


def expert_weight(name: str) -> tuple[str, int, int] | None:
    """For a checkpoint tensor of an expert: (the native parameter, expert, part), else None."""
    m = _EXPERT.match(name)
    if m is None:
        return None
    part = _PART[m.group(3)]
    return f"{m.group(1)}.mlp.{'down' if part == 2 else 'gate_up'}", int(m.group(2)), part


def stacked_experts(name: str) -> tuple[str, bool] | None:
    """For a layer's stacked experts tensor: (the native parameter, whether it is gate_up)."""
    m = _STACKED.match(name)
    if m is None:
        return None
    up = m.group(2) == "gate_up_proj"
    return f"{m.group(1)}.mlp.{'gate_up' if up else 'down'}", up


def router_weight(name: str) -> str | None:
    """The native name of a router's weight (`<layer>.mlp.router`), else None."""
    m = _ROUTER.match(name)
    return None if m is None else f"{m.group(1)}.mlp.router"


class SparseMoE(nn.Module):
    ops: LayerOps = TORCH  # SiLU * mul

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, renormalize: bool,
                 tp: TPGroup = SINGLE, experts: tuple[int, ...] | None = None) -> None:
        """`experts`: the experts this rank holds under expert parallelism (None: all of them);
        the router still scores every expert, and a token's other experts are other ranks'."""
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top-k {top_k} must be in 1..{num_experts} (the experts)")
        self.num_experts, self.top_k, self.renormalize, self.tp = num_experts, top_k, renormalize, tp
        self.experts = tuple(range(num_experts)) if experts is None else tuple(experts)
        held = len(self.experts)
        self.router = nn.Parameter(torch.empty(num_experts, hidden))
        self.gate_up = nn.Parameter(torch.empty(held, 2 * intermediate, hidden))  # [gate; up] rows
        self.down = nn.Parameter(torch.empty(held, hidden, intermediate))
        self._local: dict[torch.device, torch.Tensor] = {}  # not a buffer: the loader's to_empty() wipes those

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, both (T, k); the weights in fp32."""
        probs = torch.softmax(F.linear(x.float(), self.router.float()), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts

    def forward(self, x: torch.Tensor, num_tokens: int | None = None) -> torch.Tensor:
        """`num_tokens`: the rows that are tokens; those past it (the CPU's row-bucket padding,
        llama.py) are routed nowhere and come out zero. Routed, a zero row picks experts like
        any other: at one token padded to 16 rows that was 16 times the experts' work."""
        n = x.shape[0] if num_tokens is None else num_tokens
        tokens = x[:n]
        weights, experts = self.route(tokens)
        local = self._local_slots(x.device)[experts].flatten()  # other ranks' experts: len(self.experts), sorted last
        order = torch.argsort(local, stable=True)
        held = len(self.experts)
        offsets = torch.cumsum(torch.bincount(local, minlength=held + 1)[:held], 0, dtype=torch.int32)
        how = expert_mlp.choose(x.device, x.dtype, len(order), held, x.shape[1], self.down.shape[2])
        ys = expert_mlp.run(how, tokens, self.top_k, order, offsets, self.gate_up, self.down, self.ops.silu_and_mul)
        # HF's combine: each pair's output times its weight in the model's dtype, then a token's k
        # pairs summed at once (accumulated in fp32), so bf16 rounds where HF's rounds
        ys = ys * weights.flatten().to(x.dtype)[:, None]
        out = ys.view(n, self.top_k, -1).sum(dim=1)
        if n != x.shape[0]:
            out = F.pad(out, (0, 0, 0, x.shape[0] - n))
        return self.tp.all_reduce(out)

    def _local_slots(self, device: torch.device) -> torch.Tensor:
        """expert -> its slot among the held ones; other ranks' experts -> len(held), past them all."""
        if device not in self._local:
            held = len(self.experts)
            slots = torch.full((self.num_experts,), held, dtype=torch.long)
            slots[list(self.experts)] = torch.arange(held)
            self._local[device] = slots.to(device)
        return self._local[device]
