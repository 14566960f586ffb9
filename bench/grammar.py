"""The cost of constrained decoding: the same requests with and without a JSON schema.

    python bench/grammar.py --model smollm2 --rounds 3 --batch 1,64

A round runs the batch under the schema (A), then without it (B) with each request's
max_new_tokens set to the length A produced and ignore_eos, so both runs decode the same
number of tokens per request and the batch empties the same way: the difference is the
grammar's work (mask fill on the scheduler thread, mask apply before sampling, matcher
advance). A and B alternate, and the figure is the median per-round ratio. The schema is
compiled in round 1 only; later rounds hit the grammar cache (its hit rate is reported).
Results go to docs/results/grammar_<model>.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

# A typical structured-output schema: a record with strings, numbers, an enum, a list and a
# nested object, every string bounded as a production schema would be.
SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["name", "age", "email", "role", "skills", "address"],
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string", "maxLength": 60},
        "role": {"enum": ["engineer", "manager", "designer", "analyst"]},
        "skills": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 5},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "country"],
                    "properties": {"city": {"type": "string", "maxLength": 30},
                                   "country": {"type": "string", "maxLength": 30}}},
    },
}


def prompts(model_dir: str, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    people = ["a nurse in Lyon", "a pilot from Osaka", "a chef in Lima", "a teacher in Oslo",
              "a welder from Perth", "a poet in Dakar", "a judge from Quito", "a baker in Riga"]
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": f"Give a JSON record for {people[i % len(people)]}, #{i}."}]
        text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        out.append(tok.encode(text, add_special_tokens=False))
    return out


def timed(eng: Any, ps: list[list[int]], params: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    t = time.perf_counter()
    outs = eng.generate(ps, params)
    return time.perf_counter() - t, outs


def one_batch(eng: Any, ps: list[list[int]], rounds: int, max_new: int) -> dict[str, Any]:
    schema = json.dumps(SCHEMA)
    ratios, rows = [], []
    for r in range(rounds):
        constrained = [{"max_new_tokens": max_new, "temperature": 0.7, "seed": 100 * r + i, "json_schema": schema}
                       for i in range(len(ps))]
        t_a, outs = timed(eng, ps, constrained)
        assert not [o for o in outs if o["finish_reason"] == "abort"], outs[0]
        lengths = [len(o["token_ids"]) for o in outs]
        free = [{"max_new_tokens": n, "temperature": 0.7, "seed": 100 * r + i, "ignore_eos": True}
                for i, n in enumerate(lengths)]
        t_b, outs_b = timed(eng, ps, free)
        assert [len(o["token_ids"]) for o in outs_b] == lengths
        valid = sum(_valid(o["text"]) for o in outs)
        tokens = sum(lengths)
        ratios.append(t_b / t_a)  # constrained throughput / unconstrained throughput
        rows.append({"round": r, "tokens": tokens, "constrained_s": round(t_a, 3), "free_s": round(t_b, 3),
                     "constrained_tok_s": round(tokens / t_a, 1), "free_tok_s": round(tokens / t_b, 1),
                     "valid": valid, "stopped": sum(o["finish_reason"] == "stop" for o in outs)})
        print(json.dumps(rows[-1]), flush=True)
    return {"batch": len(ps), "throughput_ratio_median": round(statistics.median(ratios), 3), "rounds": rows}


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", default="1,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=160)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from tandem import Engine
    from tandem.engine.modelgen.resolve import resolve_model

    model_dir = str(resolve_model(args.model))
    sizes = [int(b) for b in args.batch.split(",")]
    results = []
    with Engine(model_dir, dtype=args.dtype, max_running_requests=max(sizes)) as eng:
        eng.generate(prompts(model_dir, 2), {"max_new_tokens": 4})  # warm-up
        for b in sizes:
            results.append(one_batch(eng, prompts(model_dir, b), args.rounds, args.max_new_tokens))
        grammar = eng.status()[0].info["grammar"]
    hits, misses = grammar["grammar_cache_hits"], grammar["grammar_cache_misses"]
    report = {"model": args.model, "dtype": args.dtype, "schema": SCHEMA, "results": results,
              "grammar_cache": {**grammar, "hit_rate": round(hits / max(1, hits + misses), 4)}}
    out = ROOT / "docs" / "results" / f"grammar_{args.model}.json"
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps({"batches": [(r["batch"], r["throughput_ratio_median"]) for r in results],
                      "cache": report["grammar_cache"]}))


if __name__ == "__main__":
    main()
