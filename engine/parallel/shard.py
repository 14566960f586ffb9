"""How one tensor-parallel rank's share of a model is cut (SGLang's and vLLM's split).

    attention  q heads     rank r: [r*Hq/T, (r+1)*Hq/T)          T must divide Hq
               kv heads    H % T == 0: [r*H/T, (r+1)*H/T)          split
                           T % H == 0: the one head r // (T/H)     replicated (T > H)
    MLP        gate/up rows, down columns: [r*I/T, (r+1)*I/T)     T must divide I
    vocab      embedding and LM head rows: [r*V', (r+1)*V') ∩ [0, V), V' = ceil(V/T)

Column-parallel layers (qkv, gate/up) need no communication; the row-parallel ones (o, down)
end in one all-reduce each, and the vocabulary-parallel embedding in one more. Torch-free:
the worker checks a size against a model's config before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass


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
    def vocab_rows(self) -> int:
        return self.vocab[1] - self.vocab[0]


def tp_problems(size: int, num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[str]:
    """Why `size` ranks cannot split this model ([] when they can), each a full sentence."""
    if size < 1:
        return [f"tp_size must be >= 1, got {size}"]
    out = []
    if num_heads % size:
        out.append(f"tp_size {size} does not divide the model's {num_heads} attention heads")
    if num_kv_heads % size and size % num_kv_heads:
        out.append(f"tp_size {size} neither divides nor is a multiple of the model's {num_kv_heads} KV heads")
    if intermediate_size % size:
        out.append(f"tp_size {size} does not divide the model's MLP size {intermediate_size}")
    return out


def plan_shard(rank: int, size: int, num_heads: int, num_kv_heads: int, intermediate_size: int,
               vocab_size: int) -> TPShard:
    problems = tp_problems(size, num_heads, num_kv_heads, intermediate_size)
    if problems:
        raise ValueError("; ".join(problems))
    if not 0 <= rank < size:
        raise ValueError(f"tp rank {rank} outside tp_size {size}")
    hq, inter, rows = num_heads // size, intermediate_size // size, -(-vocab_size // size)
    if num_kv_heads % size == 0:
        hk = num_kv_heads // size
        kv = (rank * hk, (rank + 1) * hk)
    else:  # more ranks than KV heads: each rank keeps the head its q heads attend to
        head = rank // (size // num_kv_heads)
        kv = (head, head + 1)
    return TPShard(rank, size, (rank * hq, (rank + 1) * hq), kv, (rank * inter, (rank + 1) * inter),
                   (rank * rows, (rank + 1) * rows), vocab_size, num_kv_heads)
