"""Attention backends behind one contract (see base.py)."""

from __future__ import annotations

from tandem.engine.attention.base import AttentionBackend


def create_backend(name: str, runner_ctx: object) -> AttentionBackend:
    """`name` is auto | torch | flashinfer; auto picks FlashInfer on CUDA."""
    device = runner_ctx.device  # type: ignore[attr-defined]
    if name == "auto":
        name = "flashinfer" if str(device).startswith("cuda") else "torch"
    if name == "torch":
        from tandem.engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(runner_ctx)
    if name == "flashinfer":
        from tandem.engine.attention.flashinfer_backend import FlashInferAttentionBackend

        return FlashInferAttentionBackend(runner_ctx)
    raise ValueError(f"unknown attention backend {name!r}")


__all__ = ["AttentionBackend", "create_backend"]
