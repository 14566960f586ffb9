"""Expert parallelism: which rank holds which experts, as a table (`ExpertPlacement.owner`), so
that a load balancer can move experts later without touching the model or the loader.

EP is folded into tensor parallelism: its ranks are the TP group's. Attention stays split by
heads; after it every rank holds every token's hidden state (the attention all-reduce), so
dispatching a token to its experts' ranks needs no message: each rank computes the tokens
routed to the experts it holds, at their whole intermediate width, and the MLP's all-reduce
combines the ranks' partial sums, the collective a TP MoE runs already. (With attention
data-parallel instead, dispatch and combine would become an all-to-all.) Torch-free: the
worker checks a size against the model's config before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ExpertPlacement:
    owner: tuple[int, ...]  # expert -> the rank that holds it

    def held_by(self, rank: int) -> tuple[int, ...]:
        return tuple(e for e, r in enumerate(self.owner) if r == rank)


def contiguous(num_experts: int, ep_size: int) -> ExpertPlacement:
    """Rank r holds experts [r*E/P, (r+1)*E/P): the starting table."""
    per = num_experts // ep_size
    return ExpertPlacement(tuple(e // per for e in range(num_experts)))


def ep_problem(ep_size: int, tp_size: int, num_experts: int) -> str | None:
    """Why `ep_size` ranks cannot hold this model's experts (None when they can)."""
    if ep_size == 1:
        return None
    if ep_size != tp_size:
        return f"ep_size {ep_size} must be 1 or tp_size {tp_size}: expert parallelism runs on the TP group's ranks"
    if num_experts == 0:
        return f"ep_size {ep_size} needs a mixture-of-experts model; this one is dense"
    if num_experts % ep_size:
        return f"ep_size {ep_size} does not divide the model's {num_experts} experts"
    return None
