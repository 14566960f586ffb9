"""Decode and prefill throughput of our offline Engine vs HF transformers, same device, one run,
with % of the memory-bandwidth roofline from a device-to-device copy measured in that run.

    # the target: an H100 (bf16, batches 1,16,64,256, context 512, prefill 8x2048)
    python bench/gpu_decode.py --model llama-1b-shape --device cuda
    python bench/gpu_decode.py --model llama-1b-shape --engine-arg disable_cuda_graph=true
    # CUDA graphs cover every batch up to max_running_requests; cap them to compare eager rows
    python bench/gpu_decode.py --model llama-1b-shape --engine-arg cuda_graph_max_bs=64
    # CPU smoke (CI): the tiny model, small shapes
    python bench/gpu_decode.py --model tiny --device cpu --batches 1,4 --context 32 --steps 8 --prefill 2x64

Decode time is a difference of two timed `generate` calls on the same prompts, both with the
prompts already in the prefix cache: T(steps new tokens) - T(1 new token). The cached prefill,
the first token and the request round trip cancel, leaving exactly steps-1 decode steps at the
full batch. Only the public API is used: `ttft` alone cannot say how many tokens the requests
admitted first decoded while later ones were still prefilling, and streaming every request
would need a consumer thread each, taking the GIL from the in-process scheduler. The rows keep
(T(steps) - slowest ttft) / (steps-1) as `engine_step_ms_ttft`, a cross-check. HF gets the
same treatment: generate(max_new_tokens=min_new_tokens=steps) minus generate(1), same dtype,
device and prompts (no padding), its default DynamicCache unless `--hf-cache static`.

Roofline: bytes per decode step = weight bytes read (all parameters; an untied input embedding
is only gathered, so it is left out) + KV read, batch x (context + steps/2) x layers x 2 x
kv_heads x head_dim x dtype size; roofline step time = bytes / copy bandwidth, where copy
bandwidth = 2 x buffer bytes / time of dst.copy_(src) (read + write counted, the usual
convention), best of 10 on a 1 GiB buffer (256 MiB on CPU). % of roofline = roofline / measured.

Prefill: the Engine serves the prompts with max_new_tokens=1 from an empty prefix cache (its own
chunking and budgets apply); HF runs one forward of the same batch (use_cache, logits_to_keep=1).
The ratio is HF time / Engine time: >= 1 means ours is faster. Engine and HF alternate round by
round; each figure is the median over --repeats rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
COPY_CONVENTION = "copy bandwidth = 2 x buffer bytes / dst.copy_(src) time (read + write), best of 10"


def resolve(name: str) -> Path:
    """A preset name (llama-1b-shape is built once, 1-2 minutes) or a model directory."""
    from tandem.engine.modelgen.resolve import resolve_model

    return resolve_model(name)


def engine_args(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs; values read as JSON when they parse (true, 256, 0.8, null), else strings."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--engine-arg wants key=value, got {item!r}")
        low = value.lower()
        try:
            out[key] = json.loads(low if low in ("true", "false", "null") else value)
        except ValueError:
            out[key] = value
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """(seconds, fn's result), the device synchronised on both sides."""
    _sync(device)
    t = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t, out


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10, inner: int = 4) -> float:
    """Bytes/s of dst.copy_(src), counting read + write (2 x nbytes); best of `reps` timings of
    `inner` back-to-back copies (so the synchronisation around a sub-ms copy does not count)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    copies = lambda: [dst.copy_(src) for _ in range(inner)]  # noqa: E731
    return 2 * nbytes * inner / min(timed(copies, device)[0] for _ in range(reps))


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads from the weights: every parameter once (tied ones once), less an
    untied input embedding, of which a step gathers only `batch` rows."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    emb = model.get_input_embeddings().weight
    if not model.config.tie_word_embeddings:
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes_per_token(cfg: Any, dsize: int) -> int:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * dsize


def prompts_for(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def sp(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def flush(eng: Any) -> None:
    """Empty the prefix cache; the scheduler may take a moment to go idle after generate returns."""
    for _ in range(100):
        if all(r.ok for r in eng.flush_cache()):
            return
        time.sleep(0.05)
    raise RuntimeError("flush_cache: the engine did not go idle")


def hf_generate(hf: Any, ids: torch.Tensor, n: int, cache: str) -> torch.Tensor:
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                       do_sample=False, pad_token_id=hf.generation_config.pad_token_id, **kw)


@torch.inference_mode()
def decode_case(eng: Any, hf: Any, batch: int, args: argparse.Namespace, device: torch.device) -> dict:
    """One batch size: Engine and HF decode tok/s (see the module docstring for the method)."""
    steps, prompts = args.steps, prompts_for(batch, args.context, hf.config.vocab_size, seed=batch)
    ids = torch.tensor(prompts, device=device)
    flush(eng)
    eng.generate(prompts, sp(2))  # warm-up: the prompts go into the prefix cache, one decode step runs
    hf_generate(hf, ids, 2, args.hf_cache)
    e_dt, e_ttft, h_dt, outs = [], [], [], []
    for _ in range(args.repeats):
        t1, _ = timed(lambda: eng.generate(prompts, sp(1)), device)
        ts, outs = timed(lambda: eng.generate(prompts, sp(steps)), device)
        e_dt.append(ts - t1)
        e_ttft.append(ts - max(o["meta"]["ttft"] for o in outs))  # cross-check: wall - slowest ttft
        h1, _ = timed(lambda: hf_generate(hf, ids, 1, args.hf_cache), device)
        h_dt.append(timed(lambda: hf_generate(hf, ids, steps, args.hf_cache), device)[0] - h1)
    assert all(o["meta"]["completion_tokens"] == steps for o in outs), "ignore_eos must give max_new_tokens"
    cached = sum(o["meta"]["cached_tokens"] for o in outs) / sum(o["meta"]["prompt_tokens"] for o in outs)
    e_step, h_step = statistics.median(e_dt) / (steps - 1), statistics.median(h_dt) / (steps - 1)
    return {"batch": batch, "context": args.context, "steps": steps, "engine_step_ms": e_step * 1e3,
            "hf_step_ms": h_step * 1e3, "engine_step_ms_ttft": statistics.median(e_ttft) / (steps - 1) * 1e3,
            "engine_tok_s": batch / e_step, "hf_tok_s": batch / h_step,
            "engine_over_hf": h_step / e_step, "engine_prompt_cached_frac": cached,
            "engine_rounds_s": e_dt, "hf_rounds_s": h_dt}


def add_roofline(row: dict, wbytes: int, kv_tok: int, bw: float) -> dict:
    kv = row["batch"] * (row["context"] + row["steps"] / 2) * kv_tok
    roof_ms = (wbytes + kv) / bw * 1e3
    return {**row, "bytes_per_step": wbytes + kv, "kv_bytes_per_step": kv, "roofline_step_ms": roof_ms,
            "engine_pct_roofline": 100 * roof_ms / row["engine_step_ms"],
            "hf_pct_roofline": 100 * roof_ms / row["hf_step_ms"]}


@torch.inference_mode()
def prefill_case(eng: Any, hf: Any, shape: str, repeats: int, device: torch.device) -> dict:
    n, length = (int(x) for x in shape.lower().split("x"))
    prompts = prompts_for(n, length, hf.config.vocab_size, seed=12345)
    ids = torch.tensor(prompts, device=device)
    forward = lambda: hf(ids, use_cache=True, logits_to_keep=1)  # noqa: E731
    e_s, h_s = [], []
    for i in range(repeats + 1):  # round 0 warms both up
        flush(eng)
        e, outs = timed(lambda: eng.generate(prompts, sp(1)), device)
        assert sum(o["meta"]["cached_tokens"] for o in outs) == 0, "prefill must start from an empty cache"
        h, _ = timed(forward, device)
        if i:
            e_s.append(e)
            h_s.append(h)
    e, h = statistics.median(e_s), statistics.median(h_s)
    return {"prefill": f"{n}x{length}", "engine_ms": e * 1e3, "hf_ms": h * 1e3, "hf_over_engine": h / e,
            "engine_tok_s": n * length / e, "hf_tok_s": n * length / h}


def table(res: dict) -> str:
    lines = [f"{res['device_name']} | torch {res['torch']} | {res['model']} {res['dtype']} | "
             f"copy bw {res['copy_bandwidth_GBps']:.1f} GB/s ({COPY_CONVENTION})",
             f"{'batch':>5} {'ctx':>5} {'engine tok/s':>13} {'hf tok/s':>11} {'eng/hf':>7} "
             f"{'roof ms':>8} {'eng ms':>8} {'eng %roof':>9} {'hf %roof':>8}"]
    for r in res["decode"]:
        lines.append(f"{r['batch']:>5} {r['context']:>5} {r['engine_tok_s']:>13.1f} {r['hf_tok_s']:>11.1f} "
                     f"{r['engine_over_hf']:>7.2f} {r['roofline_step_ms']:>8.3f} {r['engine_step_ms']:>8.3f} "
                     f"{r['engine_pct_roofline']:>8.1f}% {r['hf_pct_roofline']:>7.1f}%")
    p = res.get("prefill")
    if p:
        lines.append(f"prefill {p['prefill']}: engine {p['engine_ms']:.1f} ms, hf {p['hf_ms']:.1f} ms, "
                     f"hf/engine {p['hf_over_engine']:.2f} (>= 1: ours faster)")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-1b-shape", help="preset name, model dir, or llama-1b-shape")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--batches", default=None, help="comma-separated; default 1,16,64,256 (cuda), 1,4 (cpu)")
    ap.add_argument("--context", type=int, default=None, help="prompt tokens; default 512 (cuda), 64 (cpu)")
    ap.add_argument("--steps", type=int, default=None, help="new tokens; default 128 (cuda), 16 (cpu)")
    ap.add_argument("--prefill", default=None, help="NxLEN; default 8x2048 (cuda), 2x128 (cpu); 'none' skips")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds per case (median)")
    ap.add_argument("--hf-cache", choices=["dynamic", "static"], default="dynamic")
    ap.add_argument("--engine-arg", action="append", default=[], metavar="KEY=VALUE",
                    help="EngineConfig option, repeatable (e.g. disable_cuda_graph=true, cuda_graph_max_bs=256)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=None, help="default docs/results/gpu_decode_<device>.json")
    args = ap.parse_args()
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.batches = [int(b) for b in (args.batches or ("1,16,64,256" if cuda else "1,4")).split(",")]
    args.context = args.context or (512 if cuda else 64)
    args.steps = args.steps or (128 if cuda else 16)
    args.prefill = args.prefill or ("8x2048" if cuda else "2x128")
    if args.steps < 2:
        raise SystemExit("--steps must be >= 2 (decode time is T(steps) - T(1))")
    return args


def main() -> None:
    from transformers import AutoModelForCausalLM

    from tandem import Engine

    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    path = resolve(args.model)
    bw = copy_bandwidth(device, (1 << 30) if device.type == "cuda" else (256 << 20))
    if device.type == "cuda":
        torch.cuda.empty_cache()  # hand the copy buffers back before the Engine sizes its KV pool
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    wbytes, kv_tok = weight_bytes(hf), kv_bytes_per_token(hf.config, dtype.itemsize)
    eargs = {"device": args.device, "dtype": args.dtype, **engine_args(args.engine_arg)}
    rows, prefill = [], None
    with Engine(str(path), **eargs) as eng:
        for batch in args.batches:
            rows.append(add_roofline(decode_case(eng, hf, batch, args, device), wbytes, kv_tok, bw))
            print(json.dumps({k: v for k, v in rows[-1].items() if not k.endswith("rounds_s")}), flush=True)
        if args.prefill.lower() != "none":
            prefill = prefill_case(eng, hf, args.prefill, args.repeats, device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu ({torch.get_num_threads()} threads)"
    import transformers

    res = {"device": args.device, "device_name": name, "torch": torch.__version__,
           "transformers": transformers.__version__, "model": args.model, "model_path": str(path),
           "dtype": args.dtype, "engine_args": eargs, "hf_cache": args.hf_cache, "repeats": args.repeats,
           "copy_bandwidth_GBps": bw / 1e9, "copy_bandwidth_convention": COPY_CONVENTION,
           "weight_bytes": wbytes, "kv_bytes_per_token": kv_tok, "decode": rows, "prefill": prefill}
    print(table(res))
    out = Path(args.out) if args.out else ROOT / "docs/results" / f"gpu_decode_{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
