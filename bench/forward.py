"""Forward time of the native model runner vs HF transformers, same inputs, same run.

    python bench/forward.py --model small --dtype bfloat16 --threads 2 --out docs/results/forward.json

Cases: prefill of 8 x 256 tokens, and one decode step at batch 1, 16 and 64
with 256 cached tokens per request. HF runs eager (its default SDPA attention,
DynamicCache); ours runs the paged pool and the torch CPU backend. Each figure
is the median of --repeat runs after a warm-up; the ratio is HF / ours.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _ours(path: str, dtype: str, batch: int, ctx: int, repeat: int) -> tuple[float, float]:
    from tandem.engine.config import RunnerConfig
    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.static_generate import StaticBatch

    runner = ModelRunner(path, RunnerConfig(dtype=dtype, page_size=16, max_total_tokens=batch * (ctx + 64) + 64,
                                            max_running_requests=batch))
    sb = StaticBatch(runner)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, runner.vocab_size, (ctx,), generator=g).tolist() for _ in range(batch)]

    def prefill() -> None:
        seqs = sb.new(batch)
        sb.forward(seqs, prompts)
        sb.release(seqs)

    prefill_ms = _median_ms(prefill, repeat) if batch == 8 else float("nan")
    seqs = sb.new(batch)
    sb.forward(seqs, prompts)
    step = lambda: sb.forward(seqs, [[7]] * batch)  # noqa: E731
    decode_ms = _median_ms(step, repeat)
    sb.release(seqs)
    return prefill_ms, decode_ms


@torch.inference_mode()
def _hf(path: str, dtype: str, batch: int, ctx: int, repeat: int) -> tuple[float, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (batch, ctx), generator=g)
    prefill_ms = _median_ms(lambda: model(ids[:8], use_cache=True), repeat) if batch == 8 else float("nan")
    cache = model(ids, use_cache=True).past_key_values
    nxt = torch.full((batch, 1), 7)

    def step() -> None:
        model(nxt, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the token just added: every timed step sees the same context

    return prefill_ms, _median_ms(step, repeat)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tandem.engine.model_builder import resolve_model

    path = str(resolve_model(args.model))
    rows = []
    for batch in (8, 1, 16, 64):
        ours_p, ours_d = _ours(path, args.dtype, batch, args.ctx, args.repeat)
        hf_p, hf_d = _hf(path, args.dtype, batch, args.ctx, args.repeat)
        if batch == 8:
            rows.append({"case": f"prefill 8x{args.ctx}", "ours_ms": ours_p, "hf_ms": hf_p,
                         "hf_over_ours": hf_p / ours_p})
        else:
            rows.append({"case": f"decode bs={batch} ctx={args.ctx}", "ours_ms": ours_d, "hf_ms": hf_d,
                         "hf_over_ours": hf_d / ours_d})
        print(json.dumps(rows[-1]), flush=True)
    result = {"model": args.model, "dtype": args.dtype, "threads": args.threads, "rows": rows,
              "torch": torch.__version__}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
