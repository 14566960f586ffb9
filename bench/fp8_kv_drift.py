"""What an FP8 KV cache costs in accuracy on the real model, against the model-dtype KV, in one run.

    python bench/fp8_kv_drift.py --model smollm2 --dtype bfloat16 --max-new 64

The fixed chat set (tests/conftest.py's CHATS, through the chat template) is answered greedily with
the KV pool in the model's dtype; then, for each fp8 format:

    free-running   the fp8 pool's own greedy answers: the share of positions whose token equals the
                   reference's (one early difference makes every later position differ)
    teacher-forced along the reference answers, each next token asked of the fp8 pool (the prefix
                   read back from its cache, as a decode step reads it): the share that equals the
                   reference token, and the |logprob| drift of the reference token where both chose it
    pool bytes     per token, against the model-dtype pool

The reference pool is run teacher-forced too: in bf16 a cache hit rounds apart from a decode step
(docs/engine.md, "Deterministic mode"), so its own agreement is the floor to compare against.
Results go to docs/results/fp8_kv_drift.json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from run_meta import run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
FORMATS = ("fp8_e4m3", "fp8_e5m2")


def _teacher_forced(eng, prompts: list[list[int]], answers: list[list[int]]) -> tuple[list[bool], list[float]]:
    sp = {"max_new_tokens": 1, "temperature": 0, "return_logprob": True}
    same: list[bool] = []
    logprobs: list[float] = []
    for p, a in zip(prompts, answers):  # one chat at a time: each step hits the previous one's cache
        for i, o in enumerate(eng.generate([p + a[:i] for i in range(len(a))], sp)):
            same.append(o["token_ids"][0] == a[i])
            logprobs.append(o["meta"]["logprobs"][0] if same[-1] else float("nan"))
    return same, logprobs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "fp8_kv_drift.json")
    args = ap.parse_args()

    import torch
    from conftest import CHATS
    from transformers import AutoTokenizer

    from tandem import Engine
    from tandem.engine.modelgen.resolve import resolve_model

    path = str(resolve_model(args.model))
    tok = AutoTokenizer.from_pretrained(path)
    prompts = [tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
               for m in CHATS]
    greedy = {"max_new_tokens": args.max_new, "temperature": 0}
    result: dict = {"model": args.model, "dtype": args.dtype, "chats": len(CHATS), "max_new": args.max_new}
    with Engine(path, dtype=args.dtype, max_total_tokens=16384) as eng:
        ref = [o["token_ids"] for o in eng.generate(prompts, greedy)]
        ref_same, ref_lp = _teacher_forced(eng, prompts, ref)
        ref_bytes = eng.scheduler.runner.kv_pool.kv_buffer.element_size()
    positions = sum(map(len, ref))
    result["reference"] = {"teacher_forced_agreement": round(sum(ref_same) / positions, 4)}
    for kv in FORMATS:
        with Engine(path, dtype=args.dtype, kv_cache_dtype=kv, max_total_tokens=16384) as eng:
            free = [o["token_ids"] for o in eng.generate(prompts, greedy)]
            same, lp = _teacher_forced(eng, prompts, ref)
            kv_bytes = eng.scheduler.runner.kv_pool.kv_buffer.element_size()
        matched = sum(x == y for a, b in zip(ref, free) for x, y in zip(a, b))
        drift = [abs(a - b) for a, b, s, t in zip(lp, ref_lp, same, ref_same) if s and t]
        result[kv] = {
            "free_running_agreement": round(matched / positions, 4),
            "teacher_forced_agreement": round(sum(same) / positions, 4),
            "logprob_drift_mean": round(statistics.fmean(drift), 5),
            "logprob_drift_max": round(max(drift), 5),
            "pool_bytes_ratio": kv_bytes / ref_bytes,
        }
        print(kv, result[kv], flush=True)
    print("reference", result["reference"])
    result["meta"] = run_meta(torch.device("cpu"))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
