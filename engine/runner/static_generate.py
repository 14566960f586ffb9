"""Drive a ModelRunner directly: sequences that extend and decode in lockstep.

This is the runner's own harness (used by its tests and by `tandem generate`
before the scheduler exists): no admission control, no prefix cache. It keeps
the bookkeeping the scheduler will own later, in its simplest form:

    seq.slots[p] = KV slot of position p;  req_to_token[seq.row, :len] = seq.slots
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.engine.forward_batch import ForwardBatch, ForwardMode
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.sampler import SamplingBatch
from tandem.engine.sampling_params import SamplingParams


@dataclass
class Seq:
    row: int
    tokens: list[int] = field(default_factory=list)  # every token whose KV is stored
    slots: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        assert len(self.tokens) == len(self.slots)  # invariant: built by the static generator, one slot per token


class StaticBatch:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def new(self, n: int) -> list[Seq]:
        rows = self.runner.req_to_token_pool.alloc(n)
        if rows is None:
            raise RuntimeError("out of request slots")
        return [Seq(r) for r in rows]

    def share_prefix(self, dst: Seq, src: Seq, n_tokens: int) -> None:
        """Point dst at src's first n_tokens (page-aligned) KV, as a prefix cache hit does."""
        if n_tokens % self.runner.page_size:
            raise ValueError("shared prefixes must be page-aligned")
        dst.tokens, dst.slots = src.tokens[:n_tokens], src.slots[:n_tokens]
        self.runner.req_to_token_pool.write(dst.row, 0, torch.tensor(dst.slots))

    def forward(self, seqs: Sequence[Seq], new_tokens: Sequence[list[int]]) -> torch.Tensor:
        """Append new_tokens[i] to seqs[i] and return each sequence's last-token logits."""
        prefix = [len(s.tokens) for s in seqs]
        extend = [len(t) for t in new_tokens]
        last = [s.slots[-1] if s.slots else 0 for s in seqs]
        alloc = self.runner.kv_pool.allocator
        if all(e == 1 for e in extend) and all(prefix):
            got = alloc.alloc_decode(np.array(prefix, dtype=np.int64) + 1, np.array(last, dtype=np.int64))
            loc = None if got is None else torch.from_numpy(got)
        else:
            loc = alloc.alloc_extend(prefix, extend, last)
        if loc is None:
            raise RuntimeError("KV pool exhausted")
        mode = ForwardMode.DECODE if all(e == 1 for e in extend) and all(prefix) else ForwardMode.EXTEND
        cursor = 0
        for s, toks, p in zip(seqs, new_tokens, prefix):
            part = loc[cursor : cursor + len(toks)]
            self.runner.req_to_token_pool.write(s.row, p, part)
            s.tokens += list(toks)
            s.slots += part.tolist()
            cursor += len(toks)
        flat = [t for toks in new_tokens for t in toks]
        batch = ForwardBatch.build(
            mode, flat, [s.row for s in seqs], prefix, extend, loc, self.runner.device
        )
        return self.runner.forward(batch)

    def release(self, seqs: Sequence[Seq], owned_from: Sequence[int] | None = None) -> None:
        """Free each sequence's slots from `owned_from[i]` on (shared prefixes stay)."""
        alloc = self.runner.kv_pool.allocator
        alloc.free_group_begin()
        for i, s in enumerate(seqs):
            start = owned_from[i] if owned_from else 0
            alloc.free(torch.tensor(s.slots[start:], dtype=torch.int64))
            self.runner.req_to_token_pool.free(s.row)
        self.runner.req_to_token_pool.reclaim()  # synchronous: nothing still reads the rows
        alloc.free_group_end()

    def generate(
        self, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
    ) -> list[list[int]]:
        """Prefill all prompts, then decode in lockstep until each hits max_new_tokens or EOS."""
        seqs = self.new(len(prompts))
        eos = set(self.runner.model_config.eos_token_ids)
        outs: list[list[int]] = [[] for _ in prompts]
        live = list(range(len(prompts)))
        logits = self.forward(seqs, [list(p) for p in prompts])
        try:
            while live:
                sb = SamplingBatch.from_params([params[i] for i in live], self.runner.vocab_size, self.runner.device)
                pos = torch.tensor([len(outs[i]) for i in live], device=self.runner.device)
                ids = self.runner.sample(logits, sb, pos).next_token_ids.tolist()
                still = []
                for i, t in zip(live, ids):
                    outs[i].append(t)
                    done = len(outs[i]) >= params[i].max_new_tokens or (t in eos and not params[i].ignore_eos)
                    if not done:
                        still.append(i)
                live = still
                if live:
                    logits = self.forward([seqs[i] for i in live], [[outs[i][-1]] for i in live])
        finally:
            self.release(seqs)
        return outs
