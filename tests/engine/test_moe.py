"""Mixture-of-experts models (engine/models/moe.py): Qwen3-MoE and Mixtral against HF.

The tiny random twins are built by the project's model builder through transformers' own
config classes (tiny-qwen3-moe: 8 experts, top 2, renormalised, layer 1 dense;
tiny-mixtral: 4 experts, top 2). Greedy fp32 tokens equal HF's in every scheduler mode
(tests/engine/test_scheduler_vs_hf.py runs them with the dense presets), under tensor
parallelism and under expert parallelism; the router's choice is the fp32 one in bf16 too; a checkpoint's expert tensors
land where they belong, and a missing one is named.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import assert_whole

from tandem.engine.model_config import ModelConfig
from tandem.engine.models.moe import SparseMoE, expert_weight, router_weight

MOE = ["tiny-qwen3-moe", "tiny-mixtral"]
SP = {"max_new_tokens": 16, "temperature": 0}


def _hf_greedy(path, prompts: list[list[int]]) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.inference_mode():
        return [hf.generate(torch.tensor([p]), max_new_tokens=SP["max_new_tokens"], do_sample=False)[0, len(p):]
                .tolist() for p in prompts]


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(10, vocab, (n,), generator=g).tolist() for n in (4, 17, 33)]


def test_the_configs_name_their_experts(model_path) -> None:
    q = ModelConfig.from_pretrained(model_path("tiny-qwen3-moe"))
    assert (q.num_experts, q.num_experts_per_tok, q.norm_topk_prob) == (8, 2, True)
    assert q.sparse_layers == (0, 2, 3)  # layer 1 is in mlp_only_layers: a dense MLP
    m = ModelConfig.from_pretrained(model_path("tiny-mixtral"))
    assert (m.num_experts, m.num_experts_per_tok, m.norm_topk_prob) == (4, 2, True)
    assert m.sparse_layers == tuple(range(m.num_layers)) and m.moe_intermediate_size == m.intermediate_size


@pytest.mark.parametrize("ep", [1, 2], ids=["tp2", "tp2-ep2"])
@pytest.mark.parametrize("arch", MOE)
def test_tensor_and_expert_parallel_greedy_equals_hf(engine, model_path, arch: str, ep: int) -> None:
    """TP 2: every rank holds every expert's half of the intermediate features; EP 2: every rank
    holds half of the experts, whole (engine/parallel/experts.py)."""
    eng = engine(arch, tp_size=2, ep_size=ep, max_total_tokens=4096)
    prompts = _prompts(eng.tokenizer.vocab_size)
    got = [o["token_ids"] for o in eng.generate(prompts, SP)]
    assert_whole(eng)
    eng.shutdown()
    assert got == _hf_greedy(model_path(arch), prompts)


def test_expert_placement_is_a_table_and_bad_sizes_are_named() -> None:
    from tandem.engine.engine_config import EngineConfig
    from tandem.engine.parallel.experts import contiguous, ep_problem
    from tandem.engine.parallel.shard import plan_shard

    table = contiguous(8, 2)
    assert table.owner == (0, 0, 0, 0, 1, 1, 1, 1) and table.held_by(1) == (4, 5, 6, 7)
    shard = plan_shard(1, 2, 4, 2, 768, 8192, moe_intermediate_size=128, placement=table)
    assert shard.experts == (4, 5, 6, 7) and shard.moe_intermediate == (0, 128)  # whole experts
    assert ep_problem(2, 2, 8) is None
    assert "must be 1 or tp_size" in ep_problem(2, 4, 8)
    assert "does not divide the model's 6 experts" in ep_problem(4, 4, 6)
    assert "dense" in ep_problem(2, 2, 0)
    with pytest.raises(ValueError, match="ep_size must be 1 or tp_size"):
        EngineConfig(tp_size=2, ep_size=4)


def test_expert_parallelism_on_a_dense_model_is_refused(model_path) -> None:
    with pytest.raises(ValueError, match="needs a mixture-of-experts model"):
        ModelConfig.from_pretrained(model_path("tiny")).for_rank(0, 2, ep_size=2)


def test_routing_weights_renormalise_only_when_asked() -> None:
    torch.manual_seed(0)
    for renorm in (True, False):
        moe = SparseMoE(16, 8, num_experts=6, top_k=2, renormalize=renorm)
        with torch.no_grad():
            moe.router.normal_()
        w, e = moe.route(torch.randn(5, 16))
        assert e.shape == (5, 2) and w.dtype == torch.float32
        sums = w.sum(-1)
        assert torch.allclose(sums, torch.ones(5)) == renorm


def _random_moe(seed: int, hidden: int, inter: int, experts: int, top_k: int, renorm: bool) -> SparseMoE:
    torch.manual_seed(seed)
    moe = SparseMoE(hidden, inter, num_experts=experts, top_k=top_k, renormalize=renorm)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.2)
    return moe


def test_the_router_decides_in_fp32_under_bf16() -> None:
    """bf16 hidden states and weights: the experts and weights are those of the fp32 softmax over
    the same (bf16) values, not of a bf16 softmax."""
    moe = _random_moe(1, 64, 32, 8, 2, True).to(torch.bfloat16)
    x = torch.randn(32, 64).to(torch.bfloat16)
    w, e = moe.route(x)
    probs = torch.softmax(torch.nn.functional.linear(x.float(), moe.router.float()), -1)
    ref_w, ref_e = torch.topk(probs, 2, -1)
    assert w.dtype == torch.float32 and torch.equal(e, ref_e)
    assert torch.allclose(w, ref_w / ref_w.sum(-1, keepdim=True))


def test_the_grouped_path_equals_a_per_token_loop() -> None:
    moe = _random_moe(2, 32, 16, 5, 3, False)
    x = torch.randn(11, 32)
    w, e = moe.route(x)
    ref = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in e[t].argsort():  # ascending expert, as the grouped path adds them
            k = int(e[t, j])
            h = torch.nn.functional.linear(x[t], moe.gate_up[k])
            h = torch.nn.functional.silu(h[:16]) * h[16:]
            ref[t] += torch.nn.functional.linear(h, moe.down[k]) * w[t, j]
    assert torch.allclose(moe(x), ref, atol=1e-5)


def test_checkpoint_names_map_to_the_native_parameters() -> None:
    assert expert_weight("layers.3.mlp.experts.7.up_proj.weight") == ("layers.3.mlp.gate_up", 7, 1)
    assert expert_weight("layers.0.block_sparse_moe.experts.2.w2.weight") == ("layers.0.mlp.down", 2, 2)
    assert expert_weight("layers.0.block_sparse_moe.experts.2.w1.weight") == ("layers.0.mlp.gate_up", 2, 0)
    assert expert_weight("layers.0.mlp.gate_proj.weight") is None  # a dense layer's MLP
    assert router_weight("layers.1.block_sparse_moe.gate.weight") == "layers.1.mlp.router"
    assert router_weight("layers.1.mlp.gate_proj.weight") is None


def test_a_missing_expert_is_named(model_path, tmp_path) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from tandem.engine.models.loader import load_model

    src = model_path("tiny-mixtral")
    dst = tmp_path / "m"
    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_pretrained(dst)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.gate_up#3\.1"):
        load_model(cfg, torch.float32, torch.device("cpu"), 256)


def test_deterministic_mode_refuses_moe(engine) -> None:
    with pytest.raises(Exception, match="mixture-of-experts"):
        engine("tiny-mixtral", deterministic=True, dtype="bfloat16")


def _stacked_copy(src, dst) -> None:
    """`src` rewritten in transformers v5's stacked layout: each layer's experts in one tensor."""
    import re
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = load_file(str(dst / "model.safetensors"))
    layers: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name in [n for n in weights if ".experts." in n]:
        m = re.match(r"(.*\.mlp)\.experts\.(\d+)\.(\w+)_proj\.weight", name)
        layers.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = weights.pop(name)
    for prefix, experts in layers.items():
        order = [experts[e] for e in sorted(experts)]
        weights[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([x["gate"], x["up"]]) for x in order])
        weights[f"{prefix}.experts.down_proj"] = torch.stack([x["down"] for x in order])
    save_file(weights, str(dst / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize(("tp", "ep"), [(1, 1), (2, 1), (2, 2)])
def test_the_stacked_expert_layout_loads_alike(model_path, tmp_path, tp: int, ep: int) -> None:
    """transformers v5's stacked experts (its GGUF conversion writes them) load into the same
    parameters as per-expert tensors, on every TP or EP rank."""
    from tandem.engine.models.loader import load_model

    src = model_path("tiny-qwen3-moe")
    _stacked_copy(src, tmp_path / "stacked")
    for rank in range(tp):
        views = [ModelConfig.from_pretrained(p).for_rank(rank, tp, ep) for p in (src, tmp_path / "stacked")]
        a, b = (dict(load_model(v, torch.float32, torch.device("cpu"), 256).named_parameters()) for v in views)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_padding_rows_are_routed_nowhere() -> None:
    """The CPU pads a bf16 batch's rows to a bucket (llama.py): only the real ones reach experts."""
    moe = _random_moe(3, 32, 16, 6, 2, True)
    x = torch.randn(3, 32)
    padded = torch.cat([x, torch.zeros(13, 32)])
    out = moe(padded, num_tokens=3)
    assert torch.equal(out[:3], moe(x)) and not out[3:].any()
