"""Packed bf16 linears that stream their plain weight for a few rows (models/layers.py,
PackedLinear; kernels/cpu_kernels.stream_linear): the same product as the packed oneDNN path to
bf16 rounding, at every kernel level, with and without a bias; more rows than STREAM_ROWS go to
oneDNN; the runner counts the plain copies in the weights' bytes, and turns them off on request."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.models import layers
from tandem.engine.models.layers import STREAM_ROWS, PackedLinear, can_pack_linears

pytestmark = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.bfloat16),
                                reason="this CPU does not pack bf16 linears (oneDNN)")


@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_few_rows_stream_the_weight_and_agree_with_onednn(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 96, generator=g) * 0.05).bfloat16()
    b = torch.randn(200, generator=g).bfloat16() if bias else None
    streamed = PackedLinear(w, b, plain=w)
    calls = []
    real = cpu_kernels.stream_linear
    monkeypatch.setattr(cpu_kernels, "stream_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for m in range(1, STREAM_ROWS + 3):
        x = torch.randn(m, 96, generator=g).bfloat16()
        ref = x.float() @ w.float().T + (b.float() if b is not None else 0)
        got = streamed(x)
        assert got.dtype == torch.bfloat16 and got.shape == (m, 200)
        torch.testing.assert_close(got.float(), ref, atol=0.05, rtol=0.02)  # bf16 rounding of the sums
    assert calls == list(range(1, STREAM_ROWS + 1))  # more rows: oneDNN's packed matmul


def test_strided_rows_are_made_contiguous_first() -> None:
    w = (torch.randn(64, 32) * 0.1).bfloat16()
    x = torch.randn(2, 64).bfloat16()[:, ::2]  # (2, 32), stride 2
    torch.testing.assert_close(PackedLinear(w, plain=w)(x).float(), x.float() @ w.float().T, atol=0.05, rtol=0.02)


def test_the_runner_counts_the_plain_copies_and_can_go_without(model_path) -> None:  # type: ignore[no-untyped-def]
    from tandem.engine.model_config import RunnerConfig
    from tandem.engine.runner.model_runner import ModelRunner

    path = model_path("tiny")
    on = ModelRunner(path, RunnerConfig(dtype="bfloat16"))
    off = ModelRunner(path, RunnerConfig(dtype="bfloat16", cpu_stream_linears=False))
    if not cpu_kernels.enabled("stream_linears"):
        assert not on.stream_linears
        return
    assert on.stream_linears and not off.stream_linears
    packed = [m for m in on.model.modules() if isinstance(m, PackedLinear) and m.plain is not None]
    embed = on.model.embed_tokens.weight
    owned = [m.plain for m in packed if m.plain.data_ptr() != embed.data_ptr()]  # a tied head's is the embedding
    plain_bytes = sum(t.numel() * t.element_size() for t in owned)
    assert packed and on.weight_bytes() == off.weight_bytes() + plain_bytes
    assert layers.STREAM_ROWS >= 1
