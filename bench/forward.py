"""Forward time of the native model runner vs HF transformers, same inputs, same run.

    python bench/forward.py --model small --dtype bfloat16 --threads 2 --out docs/results/forward.json

Cases: prefill of 8 x 256 tokens, and one decode step at batch 1, 16 and 64
with 256 cached tokens per request. HF runs eager (its default SDPA attention,
DynamicCache); ours runs the paged pool and the torch CPU backend. The two
alternate round by round (--rounds, each the median of --repeat calls) so that
the shared machine's slow phases hit both; the ratio is HF / ours, the median
of the per-round ratios. `--baseline unfused` compares against ours with the
fused CPU layer ops switched off instead of HF.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _ours(path: str, dtype: str, batch: int, ctx: int, fused: bool = True):
    """The case's timed step on our runner: prefill of batch x ctx (batch 8), else one decode step.
    fused=False switches the fused CPU layer ops (norm, SiLU*mul, RoPE) off: the torch chain."""
    from tandem.engine.model_config import RunnerConfig
    from tandem.engine.runner.model_runner import ModelRunner
    from tandem.engine.runner.static_generate import StaticBatch

    runner = ModelRunner.load(path, RunnerConfig(dtype=dtype, page_size=16, max_total_tokens=batch * (ctx + 64) + 64,
                                            max_running_requests=batch, layer_ops="auto" if fused else "torch"))
    sb = StaticBatch(runner)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, runner.vocab_size, (ctx,), generator=g).tolist() for _ in range(batch)]
    if batch == 8:
        def prefill() -> None:
            seqs = sb.new(batch)
            sb.forward(seqs, prompts)
            sb.release(seqs)

        return prefill
    seqs = sb.new(batch)
    sb.forward(seqs, prompts)
    return lambda: sb.forward(seqs, [[7]] * batch)


def _hf(path: str, dtype: str, batch: int, ctx: int):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, model.config.vocab_size, (batch, ctx), generator=g)
    if batch == 8:
        return lambda: model(ids, use_cache=True)
    with torch.inference_mode():
        cache = model(ids, use_cache=True).past_key_values
    nxt = torch.full((batch, 1), 7)

    def step() -> None:
        model(nxt, past_key_values=cache, use_cache=True)
        cache.crop(-1)  # drop the token just added: every timed step sees the same context

    return step


@torch.inference_mode()
def _case(path: str, dtype: str, batch: int, ctx: int, rounds: int, repeat: int, baseline) -> dict:
    """Rounds alternate ours and the baseline, so a slow phase of the shared machine hits
    both; the ratio is the median of the per-round ratios."""
    ours, hf = _ours(path, dtype, batch, ctx), baseline(path, dtype, batch, ctx)
    ours(), hf()  # warm-up: kernel builds, oneDNN JIT, allocator
    o_ms, h_ms = [], []
    for _ in range(rounds):
        o_ms.append(median_ms(ours, repeat))
        h_ms.append(median_ms(hf, repeat))
    name = f"prefill {batch}x{ctx}" if batch == 8 else f"decode bs={batch} ctx={ctx}"
    return {"case": name, "ours_ms": statistics.median(o_ms), "base_ms": statistics.median(h_ms),
            "base_over_ours": statistics.median(h / o for h, o in zip(h_ms, o_ms)),
            "round_ratios": [round(h / o, 3) for h, o in zip(h_ms, o_ms)]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3, help="timed calls per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--baseline", choices=["hf", "unfused"], default="hf",
                    help="hf: transformers' eager forward; unfused: ours without the fused layer ops")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from tandem.engine.modelgen.resolve import resolve_model

    path = str(resolve_model(args.model))
    rows = []
    for batch in (8, 1, 16, 64):
        baseline = _hf if args.baseline == "hf" else functools.partial(_ours, fused=False)
        rows.append(_case(path, args.dtype, batch, args.ctx, args.rounds, args.repeat, baseline))
        print(json.dumps(rows[-1]), flush=True)
    result = {"baseline": args.baseline, "model": args.model, "dtype": args.dtype, "threads": args.threads,
              "rows": rows, "torch": torch.__version__}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
