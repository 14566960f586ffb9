"""The native model against HF transformers: logits and greedy tokens.

fp32 logits must match within 1e-4 relative (max |diff| / max |ref|) for
prefill with cached prefixes of 0, a partial page and several pages, batched
requests of different lengths, and 64 decode steps. Greedy sequences must be
identical to HF `generate`. bf16 is checked against HF bf16 with a looser
tolerance (documented in docs/engine.md).
"""

from __future__ import annotations

import functools

import pytest
import torch
from smoke import full

from tandem.engine.kernels import cpu_plan
from tandem.engine.model_config import RunnerConfig
from tandem.engine.models.layers import can_pack_linears
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.static_generate import StaticBatch
from tandem.engine.sampling_params import SamplingParams

ARCHS = ["tiny", "tiny-llama", "tiny-qwen2"]
PAGE = 16
REL_TOL = 1e-4


@functools.lru_cache(maxsize=8)
def _hf(path: str, dtype: torch.dtype = torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def _runner(path, dtype: str = "float32", page_size: int = PAGE, device: str = "cpu", **kw) -> ModelRunner:
    """A CPU runner unless asked: the CPU tests stay CPU tests on a machine with a GPU."""
    cfg = RunnerConfig(dtype=dtype, device=device, page_size=page_size, max_total_tokens=8192,
                       max_running_requests=16, max_context_len=1024, **kw)
    return ModelRunner.load(path, cfg)


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def _hf_logits(path, ids: list[int], dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    """HF's logits computed on `device` (the runner's: a GPU runner meets a GPU reference)."""
    hf = _hf(str(path), dtype).to(device)
    try:
        return hf(torch.tensor([ids], device=device)).logits[0].float()
    finally:
        hf.to("cpu")  # the cached model stays a CPU model for the next caller


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    if a.device != ref.device:
        raise AssertionError(f"comparing {a.device} logits against a {ref.device} reference")
    return float((a - ref).abs().max() / ref.abs().max())


def _check_pool_whole(runner: ModelRunner) -> None:
    runner.kv_pool.check_integrity(in_use_pages=0)
    runner.req_to_token_pool.check_integrity(in_use=0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("prefix_len", [0, 5, 40], ids=["no-prefix", "partial-page", "several-pages"])
def test_prefill_logits_match_hf(model_path, arch: str, prefix_len: int) -> None:
    path = model_path(arch)
    runner = _runner(path)
    sb = StaticBatch(runner)
    prompts = _prompts(runner.vocab_size, [prefix_len + n for n in (23, 57, 1, 90)])
    seqs = sb.new(len(prompts))
    if prefix_len:
        sb.forward(seqs, [p[:prefix_len] for p in prompts])  # fills the cached prefix
    logits = sb.forward(seqs, [p[prefix_len:] for p in prompts])
    for i, p in enumerate(prompts):
        assert _rel(logits[i], _hf_logits(path, p)[-1]) < REL_TOL
    sb.release(seqs)
    _check_pool_whole(runner)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_shared_between_requests(model_path, arch: str) -> None:
    """A second request reading the first one's pages, as a radix-cache hit does."""
    path = model_path(arch)
    runner = _runner(path)
    sb = StaticBatch(runner)
    base, other = _prompts(runner.vocab_size, [70, 20], seed=3)
    a, b = sb.new(2)
    sb.forward([a], [base])
    sb.share_prefix(b, a, 48)
    logits = sb.forward([b], [other])
    assert _rel(logits[0], _hf_logits(path, base[:48] + other)[-1]) < REL_TOL
    sb.release([b], owned_from=[48])
    sb.release([a])
    _check_pool_whole(runner)


@pytest.mark.parametrize("arch", [*ARCHS, "tiny-llama-d256"])
@pytest.mark.parametrize("layer_kernels", [True, False], ids=["fused-ops", "torch-ops"])
def test_decode_logits_match_hf_for_64_steps(model_path, arch: str, layer_kernels: bool) -> None:
    if not layer_kernels and arch != "tiny" and not full():
        pytest.skip("--full only; the smoke form runs the torch ops on tiny and the fused ops on every arch")
    path = model_path(arch)
    # Both layer paths; 3 requests also exercise the CPU row padding (3 rows -> 8).
    runner = _runner(path, layer_ops="auto" if layer_kernels else "torch")
    sb = StaticBatch(runner)
    prompts = _prompts(runner.vocab_size, [9, 31, 16], seed=1)
    seqs = sb.new(len(prompts))
    step_logits = [sb.forward(seqs, prompts).clone()]
    g = torch.Generator().manual_seed(2)
    # Teacher-forced random continuations: every step is checked, whatever the model prefers.
    cont = [torch.randint(10, runner.vocab_size, (64,), generator=g).tolist() for _ in prompts]
    for t in range(64):
        step_logits.append(sb.forward(seqs, [[c[t]] for c in cont]).clone())
    for i, (p, c) in enumerate(zip(prompts, cont)):
        ref = _hf_logits(path, p + c)[len(p) - 1 :]  # predictions after the prompt and each step
        ours = torch.stack([s[i] for s in step_logits])
        assert _rel(ours, ref) < REL_TOL
    sb.release(seqs)
    _check_pool_whole(runner)


def _greedy_matches_hf(path, page_size: int) -> None:
    runner = _runner(path, page_size=page_size)
    prompts = _prompts(runner.vocab_size, [3, 8, 15, 16, 17, 33, 50, 77], seed=4)
    params = [SamplingParams(max_new_tokens=24, temperature=0.0) for _ in prompts]
    ours = StaticBatch(runner).generate(prompts, params)
    hf = _hf(str(path))
    for p, o in zip(prompts, ours):
        with torch.inference_mode():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False)[0, len(p):].tolist()
        assert o == ref
    _check_pool_whole(runner)


@pytest.mark.parametrize("arch", [*ARCHS, "tiny-llama-rope", "tiny-llama-d256"])
@pytest.mark.parametrize("page_size", [1, PAGE])
def test_greedy_tokens_identical_to_hf_generate(model_path, arch: str, page_size: int) -> None:
    if page_size == 1 and arch != "tiny" and not full():
        pytest.skip("--full only; the smoke form runs every arch at page 16 and tiny at page 1 too")
    _greedy_matches_hf(model_path(arch), page_size)


@pytest.mark.parametrize("arch", ["tiny", "tiny-llama-d256"])
def test_greedy_tokens_identical_at_every_kernel_level(model_path, kernel_level: str, arch: str) -> None:
    """The whole model on each kernel build this CPU executes (every op on it), as a CPU of
    that level would run it: AVX2 and plain-lane forms included."""
    _greedy_matches_hf(model_path(arch), PAGE)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cpu", ["this-cpu", "avx2-cpu"])
def test_bf16_close_to_hf_bf16(model_path, plan_env, arch: str, cpu: str) -> None:
    """bf16 tolerance: logits within 5% of the logit range, top-1 agreement on >= 90% of positions.
    avx2-cpu: the plan of a CPU without AVX-512 (TANDEM_CPU_ISA=avx2): no oneDNN packing, the
    AVX2 kernels, torch's emulated bf16 matmul; the path such a CPU takes, slow but exact to bf16."""
    if cpu == "avx2-cpu":
        if "avx2" not in cpu_plan.levels_supported(cpu_plan.read_cpu_flags()):
            pytest.skip("this CPU does not execute AVX2")
        plan_env(TANDEM_CPU_ISA="avx2")
        assert not cpu_plan.current().pack_bf16_linears and cpu_plan.current().level == "avx2"
    _check_bf16(model_path(arch))


def _check_bf16(path, device: str = "cpu", **kw) -> ModelRunner:
    """Teacher-forced prefill + 16 decode steps; the runner's forward output is a view under
    CUDA graphs (overwritten by the next step), so each step's logits are cloned."""
    runner = _runner(path, dtype="bfloat16", device=device, **kw)
    if device == "cpu":
        packed = can_pack_linears(runner.device, runner.dtype)
        assert (runner.model.packed_head is not None) == packed  # the oneDNN-packed path, LM head included
    sb = StaticBatch(runner)
    prompts = _prompts(runner.vocab_size, [20, 45, 64], seed=5)
    seqs = sb.new(len(prompts))
    steps = [sb.forward(seqs, prompts).clone()]
    g = torch.Generator().manual_seed(6)
    cont = [torch.randint(10, runner.vocab_size, (16,), generator=g).tolist() for _ in prompts]
    for t in range(16):
        steps.append(sb.forward(seqs, [[c[t]] for c in cont]).clone())
    agree = total = 0
    for i, (p, c) in enumerate(zip(prompts, cont)):
        ref = _hf_logits(path, p + c, torch.bfloat16, device)[len(p) - 1 :]
        ours = torch.stack([s[i] for s in steps])
        assert _rel(ours, ref) < 5e-2
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += ref.shape[0]
    assert agree / total >= 0.9
    sb.release(seqs)
    _check_pool_whole(runner)
    return runner


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "cuda-graph"])
def test_flashinfer_runner_close_to_hf_bf16(model_path, arch: str, cuda_graph: bool) -> None:
    """CUDA: FlashInfer prefill + decode (optionally under CUDA graphs) against HF bf16 on the GPU,
    the layers through FlashInfer's fused norm, RoPE and SiLU*mul."""
    runner = _check_bf16(model_path(arch), "cuda", attention_backend="flashinfer", disable_cuda_graph=not cuda_graph)
    assert (runner.graph_runner is not None) == cuda_graph
    assert runner.layer_ops_name == "flashinfer"


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ARCHS)
def test_fp32_on_cuda_runs_sdpa_and_matches_hf_on_the_gpu(model_path, arch: str) -> None:
    """fp32 on CUDA: `auto` must not pick FlashInfer (no fp32 kernels); logits as exact as on CPU."""
    from tandem.engine.attention.torch_backend import TorchAttentionBackend

    path = model_path(arch)
    runner = _runner(path, device="cuda")
    assert isinstance(runner.attn_backend, TorchAttentionBackend) and runner.graph_runner is None
    sb = StaticBatch(runner)
    prompts = _prompts(runner.vocab_size, [9, 31], seed=1)
    seqs = sb.new(len(prompts))
    logits = sb.forward(seqs, prompts).clone()
    for i, p in enumerate(prompts):
        assert _rel(logits[i], _hf_logits(path, p, device="cuda")[-1]) < REL_TOL
    sb.release(seqs)
    _check_pool_whole(runner)
