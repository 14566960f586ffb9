"""What a grammar's matcher costs per token, against the matcher budget (--grammar-matcher-budget).

    python bench/grammar_matcher_cost.py                      # tiny and smollm2; JSON to docs/results/
    python bench/grammar_matcher_cost.py --models tiny --tokens 100 --out /tmp/cost.json

Per token, a constrained request's matcher fills its row of the vocabulary mask and accepts the
sampled token, on the scheduler thread (engine/grammar/matcher_budget.py meters exactly that, in
thread CPU time). Here the engine's own backend does both for a few grammars, picking each next
token at random among those the mask allows (seeded), so the walk goes where a sampling model
could go. Reported per grammar: the median, p95 and max CPU per token, and the median as a
fraction of the default budget. The pathological grammar (issue 38: nested stars over overlapping
alternatives) is the one the budget is for; the others are what ordinary traffic sends.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

GRAMMARS: dict[str, tuple[str, str]] = {
    "json_schema: a record (bench/grammar.py)": ("json_schema", ""),  # filled in from bench/grammar.py
    "json_schema: any object of strings": ("json_schema", json.dumps({"type": "object",
                                                                       "additionalProperties": {"type": "string"}})),
    "regex: a date": ("regex", r"\d{4}-\d{2}-\d{2}"),
    "ebnf: pathological": ("ebnf", 'root ::= ((((("x" | "xx")*)*)*)*)* [^\\x00-\\U0010FFFF]'),
}


def allowed(mask: Any, vocab: int) -> list[int]:
    import torch

    bits = mask[0].to(torch.int64) & 0xFFFFFFFF
    words = torch.nonzero(bits).flatten().tolist()
    return [w * 32 + b for w in words for b in range(32) if (int(bits[w]) >> b) & 1 and w * 32 + b < vocab]


def walk(backend: Any, compiled: Any, vocab: int, tokens: int, seed: int, stop_cpu: float) -> list[float]:
    """CPU seconds of fill + accept for each of up to `tokens` steps."""
    rng, matcher, mask = random.Random(seed), backend.matcher(compiled), backend.allocate_mask(1)
    costs: list[float] = []
    while len(costs) < tokens and sum(costs) < stop_cpu:
        t0 = time.thread_time()
        matcher.fill_mask(mask, 0)
        fill = time.thread_time() - t0
        choices = allowed(mask, vocab)
        if not choices:
            break
        token = rng.choice(choices)
        t0 = time.thread_time()
        matcher.accept(token)
        costs.append(fill + time.thread_time() - t0)
        if matcher.is_terminated():
            break
    return costs


def run(model: str, tokens: int, seeds: int) -> dict[str, Any]:
    from grammar import SCHEMA  # bench/grammar.py, beside this file
    from transformers import AutoTokenizer

    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.grammar.registry import create_backend
    from tandem.engine.modelgen.resolve import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    vocab = len(tok)
    backend = create_backend("xgrammar", tok, vocab, [tok.eos_token_id] if tok.eos_token_id is not None else [])
    budget = EngineConfig().grammar_matcher_budget
    out: dict[str, Any] = {"model": model, "vocab": vocab, "budget_s": budget, "grammars": {}}
    for name, (kind, text) in GRAMMARS.items():
        compiled = backend.compile(kind, text or json.dumps(SCHEMA))
        costs = sorted(c for seed in range(seeds) for c in walk(backend, compiled, vocab, tokens, seed, 5.0))
        row = {"steps": len(costs), "median_ms": 1e3 * costs[len(costs) // 2],
               "p95_ms": 1e3 * costs[int(0.95 * (len(costs) - 1))], "max_ms": 1e3 * costs[-1],
               "median_over_budget": costs[len(costs) // 2] / budget}
        out["grammars"][name] = row
        print(f"{model:8s} {name:42s} steps {row['steps']:4d}  median {row['median_ms']:8.3f} ms  "
              f"p95 {row['p95_ms']:8.3f}  max {row['max_ms']:8.3f}  median/budget {row['median_over_budget']:.3f}")
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny,smollm2")
    p.add_argument("--tokens", type=int, default=200, help="steps per walk (a walk also ends at 5 s of CPU)")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", default=str(ROOT / "docs" / "results" / "grammar_matcher_cost.json"))
    args = p.parse_args()
    import torch
    from run_meta import run_meta

    runs = [run(m, args.tokens, args.seeds) for m in args.models.split(",")]
    results = {"meta": run_meta(torch.device("cpu"), tokens=args.tokens, seeds=args.seeds), "runs": runs}
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
