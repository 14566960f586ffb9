"""How one tensor-parallel rank's share of a model is cut (SGLang's and vLLM's split).

    attention  q heads     rank r: [r*Hq/T, (r+1)*Hq/T)          T must divide Hq
               kv heads    H % T == 0: [r*H/T, (r+1)*H/T)          split
                           T % H == 0: the one head r // (T/H)     replicated (T > H)
    MLP        gate/up rows, down columns: [r*I/T, (r+1)*I/T)     T must divide I
    experts    every expert's gate/up rows, down columns, alike   T must divide the experts' I
               or, with expert parallelism, whole experts per rank (parallel/experts.py)
    vocab      embedding and LM head rows: [r*V', (r+1)*V') ∩ [0, V), V' = ceil(V/T)

Column-parallel layers (qkv, gate/up) need no communication; the row-parallel ones (o, down)
end in one all-reduce each, and the vocabulary-parallel embedding in one more. Torch-free:
the worker checks a size against a model's config before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.parallel.experts import ExpertPlacement
from tandem.protocol.kv_layout import shard_heads
from tandem.worker_contract import tp_head_problem


@dataclass(frozen=True)
class TPShard:
    rank: int
    size: int
    q_heads: tuple[int, int]  # [start, stop) of the model's attention heads
    kv_heads: tuple[int, int]  # [start, stop) of its KV heads (one head when replicated)
    intermediate: tuple[int, int]  # [start, stop) of the MLP's intermediate features
    vocab: tuple[int, int]  # [start, stop) of the rows this rank holds, padding included
    vocab_size: int  # the model's vocabulary: rows at or past it are zero padding
    total_kv_heads: int  # the model's KV heads (kv_heads is a range of them)
    moe_intermediate: tuple[int, int] = (0, 0)  # [start, stop) of every expert's intermediate features
    # Expert parallelism (parallel/experts.py): the experts this rank holds, whole; None: every
    # expert, each split by moe_intermediate.
    experts: tuple[int, ...] | None = None

    @property
    def num_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1] - self.intermediate[0]

    @property
    def moe_intermediate_size(self) -> int:
        return self.moe_intermediate[1] - self.moe_intermediate[0]

    @property
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]

    def features(self, part: str, head_dim: int) -> tuple[int, int]:
        """[start, stop) of this rank's features of a split weight: "q" or "kv" heads (times
        head_dim), the "mlp" intermediate features, or an expert's ("moe")."""
        if part == "mlp":
            return self.intermediate
        if part == "moe":
            return self.moe_intermediate
        lo, hi = self.q_heads if part == "q" else self.kv_heads
        return lo * head_dim, hi * head_dim


def tp_problems(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
                moe_intermediate_size: int = 0) -> list[str]:
    """Why `size` ranks cannot split this model ([] when they can), each a full sentence: the
    heads by the worker contract's rule (the operator checks spec.model.heads by it too), and
    the MLP width, which only the engine sees."""
    heads = tp_head_problem(size, num_heads, num_kv_heads)
    if heads is not None:
        return [heads]
    if intermediate_size % size:
        return [f"tp_size {size} does not divide the model's MLP size {intermediate_size}"]
    if moe_intermediate_size % size:
        return [f"tp_size {size} does not divide the model's expert MLP size {moe_intermediate_size}"]
    return []


def plan_shard(rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
               vocab_size: int, moe_intermediate_size: int = 0, placement: ExpertPlacement | None = None) -> TPShard:
    """`placement`: expert parallelism, each rank holding its experts whole (parallel/experts.py)."""
    split_experts = moe_intermediate_size if placement is None else 0
    problems = tp_problems(size, num_heads, num_kv_heads, intermediate_size, split_experts)
    if problems:
        raise ValueError("; ".join(problems))
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} outside tp_size {size}")
    hq, inter, rows = num_heads // size, intermediate_size // size, -(-vocab_size // size)
    moe = (rank * (moe_intermediate_size // size), (rank + 1) * (moe_intermediate_size // size))
    if placement is not None:
        moe = (0, moe_intermediate_size)
    return TPShard(rank, size, (rank * hq, (rank + 1) * hq), shard_heads(num_kv_heads, size, rank),
                   (rank * inter, (rank + 1) * inter), (rank * rows, (rank + 1) * rows), vocab_size, num_kv_heads,
                   moe, None if placement is None else placement.held_by(rank))
