"""Mixture of experts on CPU: the Engine against HF transformers' generate, side by side in one run.

    python bench/moe_cpu.py --model qwen3-moe-small-shape --dtype bfloat16 --rounds 3

The model (default: the `qwen3-moe-small-shape` preset, Qwen3-30B-A3B's proportions at 1/20 of
its width: 32 experts, top 4) runs each workload in the offline Engine and in HF's generate()
(its DynamicCache, eager), in alternating rounds (A B A B ...) so that drift on a shared machine
hits both; each ratio is the median of the per-round ratios:

    decode-1     one request, 64 new tokens             (tok/s of output)
    decode-16    16 requests together, 64 new tokens    (tok/s of output)
    prefill      4 prompts of 512 tokens, 1 new token   (tok/s of prompt)

Results go to docs/results/moe_cpu.json (--out to change).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_meta import run_meta  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = {"decode-1": (1, 32, 64), "decode-16": (16, 32, 64), "prefill": (4, 512, 1)}  # requests, prompt, new


def _ours(eng, prompts, sp: dict) -> float:
    eng.flush_cache()  # every round computes its prompts, as HF does
    t = time.perf_counter()
    eng.generate(prompts.tolist(), sp)
    return time.perf_counter() - t


def _theirs(hf, prompts, new: int) -> float:
    import torch

    t = time.perf_counter()
    with torch.inference_mode():
        hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new, min_new_tokens=new,
                    do_sample=False)
    return time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-moe-small-shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "moe_cpu.json")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from tandem import Engine
    from tandem.engine.modelgen.resolve import resolve_model

    path = str(resolve_model(args.model))
    dtype = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    eng = Engine(path, dtype=args.dtype, max_total_tokens=16384, chunked_prefill_size=4096)
    g = torch.Generator().manual_seed(0)
    result: dict = {"model": args.model, "dtype": args.dtype, "rounds": args.rounds, "workloads": {}}
    for name, (n, prompt_len, new) in WORKLOADS.items():
        prompts = torch.randint(100, hf.config.vocab_size, (n, prompt_len), generator=g)
        sp = {"max_new_tokens": new, "temperature": 0, "ignore_eos": True}
        tokens = n * (prompt_len if name == "prefill" else new)

        _ours(eng, prompts, sp), _theirs(hf, prompts, new)  # warm-up at the timed shape
        rows = [(_ours(eng, prompts, sp), _theirs(hf, prompts, new)) for _ in range(args.rounds)]
        result["workloads"][name] = {
            "ours_tok_s": round(tokens / statistics.median(a for a, _ in rows), 1),
            "hf_tok_s": round(tokens / statistics.median(b for _, b in rows), 1),
            "ratio": round(statistics.median(b / a for a, b in rows), 2),
        }
        print(name, result["workloads"][name], flush=True)
    eng.shutdown()
    result["meta"] = run_meta(torch.device("cpu"))
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
