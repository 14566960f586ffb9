"""On-device sampling: greedy, temperature, top-k, top-p, min-p, seeded.

Only the chosen token ids (and logprobs when asked) leave the device.

Seeded sampling uses the Gumbel-max trick with noise that is a pure hash of
(request seed, output position, vocab index):

    token = argmax_v( log p_filtered(v) + G(seed, pos, v) ),  G = -log(-log U)

which draws exactly from p_filtered, needs no generator state, and gives the
same token whether a step is replayed after retraction or run under overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.sampling_params import SamplingParams
from tandem.protocol.logprobs import LOGPROB_FLOOR

_MASK32 = 0xFFFFFFFF


@dataclass
class SamplingBatch:
    """Per-row sampling parameters of one batch, as device tensors."""

    temperatures: torch.Tensor  # (batch, 1) float; greedy rows hold 1.0
    top_ps: torch.Tensor  # (batch, 1)
    top_ks: torch.Tensor  # (batch, 1) int64; vocab size when unset
    min_ps: torch.Tensor  # (batch, 1)
    seeds: torch.Tensor  # (batch,) int64
    greedy: torch.Tensor  # (batch,) bool
    all_greedy: bool
    need_sort: bool
    top_logprobs_num: int  # max over rows; 0 = none
    return_logprob: bool
    any_greedy: bool = True

    @classmethod
    def from_params(
        cls, params: Sequence[SamplingParams], vocab_size: int, device: torch.device | str
    ) -> SamplingBatch:
        greedy = [p.is_greedy for p in params]
        # Clamped to the vocabulary: topk() past it raises, and the batch would fail with it.
        top_n = min(max((p.top_logprobs_num for p in params), default=0), vocab_size)
        want_lp = any(p.return_logprob for p in params)
        if all(greedy):  # the common serving case: skip building per-row tensors
            return cls(None, None, None, None, None, None, True, False, top_n, want_lp)  # type: ignore[arg-type]
        f = lambda xs, dt=torch.float32: torch.tensor(xs, dtype=dt).to(device, non_blocking=True)
        return cls(
            temperatures=f([1.0 if g else p.temperature for p, g in zip(params, greedy)]).view(-1, 1),
            top_ps=f([p.top_p for p in params]).view(-1, 1),
            # top_k >= vocab keeps every token; clamped, any top_k the params accept fits int64.
            top_ks=f([p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params], torch.int64).view(-1, 1),
            min_ps=f([p.min_p for p in params]).view(-1, 1),
            seeds=f([p.seed for p in params], torch.int64),
            greedy=f(greedy, torch.bool),
            all_greedy=all(greedy),
            need_sort=any(
                not g and (p.top_p < 1.0 or 0 < p.top_k < vocab_size or p.min_p > 0) for p, g in zip(params, greedy)
            ),
            top_logprobs_num=top_n,
            return_logprob=want_lp,
            any_greedy=any(greedy),
        )


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # (batch,) int64
    logprobs: torch.Tensor | None = None  # (batch,) logprob of the chosen token
    top_logprobs: torch.Tensor | None = None  # (batch, n)
    top_ids: torch.Tensor | None = None  # (batch, n)


def _gumbel(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """(batch, vocab) Gumbel noise from a murmur3-style 32-bit hash; int64 math
    wraps on overflow and the masks keep the low 32 bits, as uint32 would."""
    key = (seeds * 0x9E3779B1 + positions * 0x85EBCA77) & _MASK32
    col = (torch.arange(vocab, device=seeds.device, dtype=torch.int64) * 0xC2B2AE3D) & _MASK32
    x = key[:, None] ^ col[None, :]
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _MASK32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _MASK32
    x = x ^ (x >> 16)
    return -torch.log(-torch.log(_uniform(x)))


def _uniform(x: torch.Tensor) -> torch.Tensor:
    """uint32 hash (in int64) -> float32 in (0, 1). 23 bits: k + 0.5 is exact in float32
    for k < 2^23, so u < 1 always. (With 24 bits the top value rounded to u = 1.0, i.e.
    infinite noise: a token drawn at random, even one the filters dropped.)"""
    return ((x >> 9).float() + 0.5) * (1.0 / (1 << 23))


def _filtered_logprobs(logits: torch.Tensor, sb: SamplingBatch) -> torch.Tensor:
    logp = torch.log_softmax(logits / sb.temperatures, dim=-1)
    if not sb.need_sort:
        return logp
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    sorted_p = sorted_logp.exp()
    rank = torch.arange(logp.shape[-1], device=logp.device)[None, :]
    drop = rank >= sb.top_ks
    drop |= (sorted_p.cumsum(-1) - sorted_p) > sb.top_ps  # keep the smallest set reaching top_p
    drop |= sorted_p < sb.min_ps * sorted_p[:, :1]
    drop[:, 0] = False  # the most likely token always survives
    sorted_logp = sorted_logp.masked_fill(drop, float("-inf"))
    return torch.empty_like(logp).scatter_(-1, order, sorted_logp)


def sample(logits: torch.Tensor, sb: SamplingBatch, positions: torch.Tensor) -> SampleOutput:
    """logits: (batch, vocab) fp32; positions: (batch,) output index of the token drawn."""
    on_cpu_kernels = logits.device.type == "cpu" and cpu_kernels.enabled("sampling")
    argmax = cpu_kernels.greedy_argmax if on_cpu_kernels else (lambda x: x.argmax(dim=-1))
    if sb.all_greedy:
        ids = argmax(logits)
    elif on_cpu_kernels:
        # One pass over the vocab instead of ~12 tensors (and no sort for the filters).
        # log_softmax only shifts each row, so the draw uses logits / temperature.
        ids = cpu_kernels.gumbel_argmax(
            logits, 1.0 / sb.temperatures, sb.seeds, positions, sb.top_ks, sb.top_ps, sb.min_ps)
    else:
        logp = _filtered_logprobs(logits, sb)
        ids = (logp + _gumbel(sb.seeds, positions, logits.shape[-1])).argmax(dim=-1)
    if not sb.all_greedy and sb.any_greedy:
        ids = torch.where(sb.greedy, argmax(logits), ids)
    out = SampleOutput(next_token_ids=ids)
    if sb.return_logprob or sb.top_logprobs_num:
        # Logprobs are reported from the model's own distribution, before
        # temperature and filtering, as OpenAI's API does.
        raw = torch.log_softmax(logits, dim=-1)
        out.logprobs = _floored(raw.gather(-1, ids[:, None]).squeeze(-1))
        if sb.top_logprobs_num:
            top, out.top_ids = raw.topk(sb.top_logprobs_num, dim=-1)
            out.top_logprobs = _floored(top)
    return out


def _floored(logprobs: torch.Tensor) -> torch.Tensor:
    """A grammar mask leaves the tokens it blocks at -inf, and a broken row may be NaN: every
    logprob that leaves the device is a finite number (tandem/protocol/logprobs.py). Only the
    gathered (batch, n) values are touched, never the vocabulary."""
    return torch.nan_to_num(logprobs, nan=LOGPROB_FLOOR, posinf=0.0, neginf=LOGPROB_FLOOR).clamp_(LOGPROB_FLOOR, 0.0)
