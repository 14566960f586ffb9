"""The experts' MLP seam (engine/models/expert_mlp.py): every implementation against one
reference, a plain loop over the pairs. The CPU kernel runs on every level's build this CPU
executes; the Triton kernel on CPU through Triton's interpreter (in a child process, as the
interpreter must be chosen before Triton is imported), and on the GPU where one is lent."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tandem.engine.models import expert_mlp
from tandem.engine.models.moe import SparseMoE

# The check runs in this process for the torch forms and in a child for Triton's interpreter.
_CHECK = """
import torch
import torch.nn.functional as F
from tandem.engine.models import expert_mlp

def silu_mul(h):
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u

def reference(x, top_k, experts, gate_up, down, held):
    out = torch.zeros(experts.numel(), x.shape[1], dtype=torch.float64)
    for p, e in enumerate(experts.flatten().tolist()):
        if e in held:
            i = held.index(e)
            h = silu_mul(gate_up[i].double() @ x[p // top_k].double())
            out[p] = down[i].double() @ h
    return out

def inputs(tokens, num_experts, top_k, held, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 48, generator=g).to(dtype)
    gate_up = (torch.randn(len(held), 2 * 32, 48, generator=g) / 7).to(dtype)
    down = (torch.randn(len(held), 48, 32, generator=g) / 6).to(dtype)
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:top_k] for _ in range(tokens)]
                          or [torch.zeros(top_k, dtype=torch.long)])[:tokens]
    if tokens:
        experts[: tokens // 2, 0] = held[0]  # one expert crowded past a block, others empty
    slots = torch.full((num_experts,), len(held))
    slots[held] = torch.arange(len(held))
    local = slots[experts].flatten()
    order = torch.argsort(local, stable=True)
    offsets = torch.cumsum(torch.bincount(local, minlength=len(held) + 1)[: len(held)], 0, dtype=torch.int32)
    return x, experts, gate_up, down, order, offsets

def check(how, device):
    for tokens, num_experts, top_k, held in ((1, 8, 2, list(range(8))), (40, 8, 2, list(range(8))),
                                             (37, 6, 3, [3, 4, 5]), (0, 4, 1, [0, 1, 2, 3])):
        for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
            x, experts, gate_up, down, order, offsets = inputs(tokens, num_experts, top_k, held, dtype, tokens)
            want = reference(x, top_k, experts, gate_up, down, held)
            got = expert_mlp.run(how, *(t.to(device) for t in (x,)), top_k, order.to(device), offsets.to(device),
                                 gate_up.to(device), down.to(device), silu_mul).double().cpu()
            assert got.shape == want.shape, (how, got.shape, want.shape)
            err, top = ((got - want).abs().max().item(), want.abs().max().item()) if tokens else (0.0, 0.0)
            assert err <= tol * max(1.0, top), (how, tokens, held, dtype, err)
    print("same")
"""


@pytest.mark.parametrize("how", ["grouped", "per_expert"])
def test_each_torch_form_equals_the_reference(how: str) -> None:
    if how == "grouped" and not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no grouped matmul")
    scope: dict = {}
    exec(_CHECK, scope)
    scope["check"](how, "cpu")


@pytest.mark.usefixtures("kernel_level")
def test_the_cpu_kernel_equals_the_reference() -> None:
    scope: dict = {}
    exec(_CHECK, scope)
    scope["check"]("cpu_kernel", "cpu")


def test_the_cpu_kernel_refuses_what_it_cannot_read() -> None:
    from tandem.engine.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    x, w = torch.randn(5, 32), torch.randn(2, 8, 32)
    for offsets in ([3, 2], [3, 6], [-1, 5], [5]):  # falling, past the rows, negative, one per expert missing
        with pytest.raises(RuntimeError, match="offsets"):
            cpu_kernels.expert_gemm(x, w, torch.tensor(offsets, dtype=torch.int32))
    with pytest.raises(RuntimeError, match="multiple of 16"):
        cpu_kernels.expert_gemm(torch.randn(5, 24), torch.randn(2, 8, 24), torch.tensor([2, 5], dtype=torch.int32))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_the_triton_kernel_equals_the_reference(device: str) -> None:
    pytest.importorskip("triton")
    env = {**os.environ, **({"TRITON_INTERPRET": "1"} if device == "cpu" else {})}
    script = _CHECK + f"\ncheck('triton', {device!r})\n"
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600, cwd="/")
    assert out.stdout.strip() == "same", out.stderr[-3000:]


def test_the_block_table_gives_each_pair_one_row_of_its_experts_block() -> None:
    from tandem.engine.models.moe_triton import block_table

    order = torch.tensor([4, 0, 2, 5, 1, 3, 6])  # sorted: expert 0 has 1 pair, 1 has 0, 2 has 4; 2 not held
    offsets = torch.tensor([1, 1, 5], dtype=torch.int32)
    blocks, rows = block_table(order, offsets, block_m=2)
    assert blocks.tolist() == [0, 2, 2, -1, -1, -1, -1]  # a bound of ceil(7 / 2) + 3 blocks
    assert rows.view(-1, 2).tolist()[:3] == [[4, 7], [0, 2], [5, 1]]  # 7: a padding row
    assert sorted(r for r in rows.tolist() if r < 7) == [0, 1, 2, 4, 5]  # held pairs once, others never


def test_the_choice_follows_the_batch_shape(plan_env) -> None:
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert expert_mlp.choose(cpu, bf16, 2048 * 4, 32, 1024, 256) == "per_expert"  # a prefill: many rows an expert
    decode = expert_mlp.choose(cpu, bf16, 16 * 4, 32, 1024, 256)  # a decode step: few
    from tandem.engine.kernels import cpu_kernels

    assert decode == ("cpu_kernel" if cpu_kernels.enabled("experts") else "grouped")
    assert expert_mlp.choose(cpu, bf16, 16 * 4, 32, 1000, 256) != "cpu_kernel"  # the kernel's shapes only
    plan_env(TANDEM_DISABLE_CPU_KERNELS="1")
    if hasattr(torch, "_grouped_mm"):
        assert expert_mlp.choose(cpu, bf16, 16 * 4, 32, 1024, 256) == "grouped"


@pytest.mark.parametrize("tokens", [1, 300])
def test_the_block_answers_alike_whichever_form_runs(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    moe = SparseMoE(32, 16, num_experts=6, top_k=2, renormalize=True)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / 5)
    x = torch.randn(tokens + 3, 32, generator=g)
    outs = []
    from tandem.engine.kernels import cpu_kernels

    forms = ["per_expert"] + ["grouped"] * hasattr(torch, "_grouped_mm") + ["cpu_kernel"] * cpu_kernels.available()
    for how in forms:
        monkeypatch.setattr(expert_mlp, "choose", lambda *a, how=how: how)
        out = moe(x, num_tokens=tokens)
        assert torch.equal(out[tokens:], torch.zeros(3, 32))  # padding rows are routed nowhere
        outs.append(out)
    assert all(torch.allclose(o, outs[0], atol=1e-5) for o in outs)
