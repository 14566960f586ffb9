"""A CPU decode step with each decoder layer in one kernel call (models/fused_decode.py,
csrc/decode_layer_cpu.cpp): the same bits as the module loop it replaces, in fp32 (panels) and
bf16 (streamed weights), at every kernel level and for each dense architecture's switches
(qk-norm, qkv bias, an untied head); taken only where it holds; its argument checks raise rather
than crash."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.model_config import RunnerConfig
from tandem.engine.models.layers import STREAM_ROWS, can_pack_linears
from tandem.engine.runner.model_runner import ModelRunner
from tandem.engine.runner.static_generate import StaticBatch

pytestmark = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.float32),
                                reason="no oneDNN in this torch")


def _decode(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill the prompts together, then decode them greedily in lockstep: every step's logits."""
    sb = StaticBatch(runner)
    seqs = sb.new(len(prompts))
    out = [sb.forward(seqs, prompts)]
    for _ in range(steps):
        out.append(sb.forward(seqs, [[int(t)] for t in out[-1].argmax(-1)]))
    sb.release(seqs)
    return out


def _runner(path, dtype: str = "float32", **config) -> ModelRunner:  # type: ignore[no-untyped-def]
    return ModelRunner.load(path, RunnerConfig(dtype=dtype, max_total_tokens=512, max_running_requests=4, **config))


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("preset", ["tiny", "tiny-llama", "tiny-qwen2"])
def test_one_call_per_layer_is_the_module_loop_bit_for_bit(model_path, preset: str, dtype: str,  # type: ignore[no-untyped-def]
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    if not can_pack_linears(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"this CPU does not pack {dtype} linears (oneDNN)")
    runner = _runner(model_path(preset), dtype)
    fused = runner.model.fused_decode
    assert fused is not None and len(fused.layers) == runner.model_config.num_layers
    calls = []
    real = cpu_kernels.decode_layer
    monkeypatch.setattr(cpu_kernels, "decode_layer", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    prompts = [[5, 9, 17, 33, 2], list(range(40, 71)), [3]]
    with torch.inference_mode():
        one_call = _decode(runner, prompts, steps=6)
        assert calls == [3] * 6 * len(fused.layers)  # every decode step, no prefill
        runner.model.fused_decode = None
        modules = _decode(runner, prompts, steps=6)
    for a, b in zip(one_call, modules):
        assert torch.equal(a, b)
    runner.kv_pool.check_integrity(in_use_pages=0)  # every slot back
    runner.req_to_token_pool.check_integrity(in_use=0)


def test_it_is_taken_only_where_it_holds(model_path) -> None:  # type: ignore[no-untyped-def]
    path = model_path("tiny")
    if not (cpu_kernels.enabled("stream_linears") and cpu_kernels.enabled("layer_ops")):
        assert _runner(path).model.fused_decode is None
        return
    assert _runner(path).model.fused_decode is not None
    assert _runner(path, layer_ops="torch").model.fused_decode is None  # the HF chain, op for op
    assert _runner(path, cpu_stream_linears=False).model.fused_decode is None  # no panels
    assert _runner(path, deterministic=True).model.fused_decode is None  # its fp32 blocks are torch's matmuls
    assert _runner(model_path("tiny-qwen3-moe")).model.fused_decode is None  # experts, not a dense MLP
    if can_pack_linears(torch.device("cpu"), torch.bfloat16):
        bf16 = _runner(path, "bfloat16").model.fused_decode
        assert bf16 is not None and bf16.max_rows == STREAM_ROWS  # the streamed weights' limit


def test_more_rows_than_the_panels_take_run_the_modules(model_path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    runner = _runner(model_path("tiny"))
    fused = runner.model.fused_decode
    if fused is None:
        pytest.skip("the CPU kernels don't run whole layers here")
    calls = []
    monkeypatch.setattr(cpu_kernels, "decode_layer", lambda *a: calls.append(1))
    fused.max_rows = 2
    with torch.inference_mode():
        _decode(runner, [[1, 2], [3, 4], [5, 6]], steps=1)
    assert calls == []


@pytest.mark.parametrize("case", ["weights", "dtype", "rows", "residual"])
def test_the_layer_kernel_refuses_mismatched_arguments(model_path, case: str) -> None:  # type: ignore[no-untyped-def]
    runner = _runner(model_path("tiny"))
    fused = runner.model.fused_decode
    if fused is None:
        pytest.skip("the CPU kernels don't run whole layers here")
    weights, bias = fused.layers[0]
    hidden = runner.model_config.hidden_size
    x, residual = torch.randn(1, hidden), torch.empty(1, hidden)
    rows, lens = torch.zeros(1, dtype=torch.int64), torch.ones(1, dtype=torch.int32)
    loc, pos = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)
    if case == "weights":
        weights = weights[:7]
    elif case == "dtype":  # bf16 activations against fp32 panels
        x, residual = x.bfloat16(), residual.bfloat16()
    elif case == "rows":
        rows = torch.zeros(2, dtype=torch.int64)
    else:
        residual = torch.empty(2, hidden)
    pool = runner.kv_pool
    hq, hkv, dim = fused.heads
    # its own checks name it; the dtype mismatch is the first kernel's (the norm's) to refuse
    with pytest.raises(RuntimeError, match="norm weight" if case == "dtype" else "decode_layer"):
        cpu_kernels.decode_layer(x, residual, False, weights, bias, pos, runner.model.rope.cos, runner.model.rope.sin,
                                 pool.k_buffer(0), pool.v_buffer(0), loc, runner.req_to_token_pool.req_to_token, rows,
                                 lens, hq, hkv, dim, 1e-6, 0.125)


def test_the_benchmark_runs(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """bench/cpu_fused_decode.py in its smallest form: a row per batch, with the ratio or the reason it skipped."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "bench" / "cpu_fused_decode.py"
    out = tmp_path / "fused.json"
    subprocess.run([sys.executable, str(script), "--model", "tiny", "--batches", "1,2", "--rounds", "1",
                    "--repeat", "1", "--out", str(out)], check=True, timeout=300, capture_output=True)
    rows = json.loads(out.read_text())["rows"]
    if cpu_kernels.enabled("stream_linears") and cpu_kernels.enabled("layer_ops"):
        assert [r["batch"] for r in rows] == [1, 2] and all(r["modules_over_one_call"] > 0 for r in rows)
