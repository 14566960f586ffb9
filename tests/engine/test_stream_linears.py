"""Packed linears that keep a second form of their weight for calls of few rows (models/layers.py,
PackedLinear, small_rows_form): bf16 streams the weight as stored (cpu_kernels.stream_linear) for
up to STREAM_ROWS rows, fp32 its panels (cpu_kernels.panel_linear) for up to panel_rows() (by kernel level). Each
gives the packed oneDNN product (to bf16 rounding, or to fp32 summation order) at every kernel
level, with and without a bias; more rows go to oneDNN; the runner counts the copies in the
weights' bytes, and turns them off on request."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.kernels import cpu_kernels
from tandem.engine.models import layers
from tandem.engine.models.layers import PANEL_ROWS, STREAM_ROWS, PackedLinear, can_pack_linears

bf16_packs = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.bfloat16),
                                reason="this CPU does not pack bf16 linears (oneDNN)")
fp32_packs = pytest.mark.skipif(not can_pack_linears(torch.device("cpu"), torch.float32),
                                reason="no oneDNN in this torch")


@bf16_packs
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_a_few_rows_stream_the_weight_and_agree_with_onednn(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(200, 96, generator=g) * 0.05).bfloat16()
    b = torch.randn(200, generator=g).bfloat16() if bias else None
    streamed = PackedLinear(w, b, small=w)
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


@bf16_packs
def test_strided_rows_are_made_contiguous_first() -> None:
    w = (torch.randn(64, 32) * 0.1).bfloat16()
    x = torch.randn(2, 64).bfloat16()[:, ::2]  # (2, 32), stride 2
    torch.testing.assert_close(PackedLinear(w, small=w)(x).float(), x.float() @ w.float().T, atol=0.05, rtol=0.02)


@fp32_packs
@pytest.mark.usefixtures("kernel_level")
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_fp32_rows_up_to_panel_rows_take_the_panels_and_agree(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    n, k = 203, 72  # a partial last panel, and input features no multiple of 16
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    lin = PackedLinear(w, b, small=cpu_kernels.pack_panels(w))
    calls = []
    real = cpu_kernels.panel_linear
    monkeypatch.setattr(cpu_kernels, "panel_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    rows = layers.panel_rows()
    assert lin.small_rows == rows
    sizes = sorted({1, 2, 5, 6, 7, 12, 13, 64, rows, rows + 1})
    for m in sizes:
        x = torch.randn(m, k, generator=g)
        ref = (x.double() @ w.double().T + (b.double() if b is not None else 0)).float()
        got = lin(x)
        assert got.dtype == torch.float32 and got.shape == (m, n)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)  # fp32 sums in another order
    assert calls == [m for m in sizes if m <= rows]  # more rows: oneDNN's packed matmul


@pytest.mark.usefixtures("kernel_level")
def test_a_rows_panel_product_does_not_depend_on_the_other_rows() -> None:
    """Each output is one FMA chain over k: the row blocking a batch size picks changes no bit."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 576, generator=g)
    panels = cpu_kernels.pack_panels(w)
    x = torch.randn(PANEL_ROWS, 576, generator=g)
    alone = torch.cat([cpu_kernels.panel_linear(x[i:i + 1], panels, 96) for i in range(0, PANEL_ROWS, 17)])
    together = cpu_kernels.panel_linear(x, panels, 96)[::17]
    assert torch.equal(alone, together)


@pytest.mark.parametrize("case", ["bf16", "k", "n", "bias", "strided"])
def test_the_panel_kernel_refuses_mismatched_arguments(case: str) -> None:
    if not cpu_kernels.enabled("stream_linears"):
        pytest.skip("the CPU kernels don't run the small-rows linears here")
    w = torch.randn(40, 32)
    panels, x, n, bias = cpu_kernels.pack_panels(w), torch.randn(3, 32), 40, None
    if case == "bf16":
        x = x.bfloat16()
    elif case == "k":
        x = torch.randn(3, 48)
    elif case == "n":
        n = 80  # more output features than the panels hold
    elif case == "bias":
        bias = torch.randn(39)
    else:
        x = torch.randn(3, 64)[:, ::2]
    with pytest.raises(RuntimeError, match="panel_linear"):
        cpu_kernels.panel_linear(x, panels, n, bias)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_runner_counts_the_copies_and_can_go_without(model_path, dtype: str) -> None:  # type: ignore[no-untyped-def]
    from tandem.engine.model_config import RunnerConfig
    from tandem.engine.runner.model_runner import ModelRunner

    if not can_pack_linears(torch.device("cpu"), getattr(torch, dtype)):
        pytest.skip(f"this CPU does not pack {dtype} linears (oneDNN)")
    path = model_path("tiny")
    on = ModelRunner(path, RunnerConfig(dtype=dtype))
    off = ModelRunner(path, RunnerConfig(dtype=dtype, cpu_stream_linears=False))
    if not cpu_kernels.enabled("stream_linears"):
        assert not on.stream_linears
        return
    assert on.stream_linears and not off.stream_linears
    packed = [m for m in on.model.modules() if isinstance(m, PackedLinear) and m.small is not None]
    assert packed and all(m.panels == (dtype == "float32") for m in packed)
    embed = on.model.embed_tokens.weight
    owned = [m.small for m in packed if m.small.data_ptr() != embed.data_ptr()]  # a tied bf16 head's is the embedding
    copy_bytes = sum(t.numel() * t.element_size() for t in owned)
    assert on.weight_bytes() == off.weight_bytes() + copy_bytes
    assert layers.STREAM_ROWS >= 1 and layers.PANEL_ROWS >= layers.PANEL_ROWS_AVX2 >= layers.STREAM_ROWS
