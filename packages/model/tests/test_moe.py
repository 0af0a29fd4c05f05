"""The MoE block against an explicit float64 loop over tokens, its training signals, and the serving fast paths."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import StaticDecode, make_cache
from plyx.model import TransformerLM
from plyx.model._moe import SparseMoE, load_balancing_loss
from plyx.specs.config import MoEConfig

MOE = dict(num_experts=5, top_k=2, d_expert=24)
FAMILIES = {  # the four Hugging Face MoE families as plyx configs
    "mixtral": dict(arch="mistral", moe=MoEConfig(**MOE)),
    "qwen2_moe": dict(arch="qwen2", qkv_bias=True, moe=MoEConfig(**MOE, norm_topk_prob=False, shared_expert_d_ff=40)),
    "qwen3_moe": dict(arch="qwen3", qk_norm=True, head_dim=16, moe=MoEConfig(**MOE)),
    "olmoe": dict(arch="llama", qk_norm=True, qk_norm_scope="projection", moe=MoEConfig(**MOE, norm_topk_prob=False)),
}


def _explicit(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The MoE MLP written token by token in float64: softmax, top-k, (renormalise), weighted expert sum."""
    x = x.double().reshape(-1, x.shape[-1])
    wr, gu, dn = block.gate.weight.double(), block.experts.gate_up_proj.double(), block.experts.down_proj.double()
    f = block.experts.d_expert
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        p = torch.softmax(x[t] @ wr.T, -1)
        w, ids = p.topk(block.top_k)
        if block.norm_topk_prob:
            w = w / w.sum()
        for wj, e in zip(w, ids.tolist()):
            h = gu[e] @ x[t]
            out[t] += wj * (dn[e] @ (torch.nn.functional.silu(h[:f]) * h[f:]))
        if block.shared_expert is not None:
            s = block.shared_expert
            g, u = s.gate_proj.weight.double() @ x[t], s.up_proj.weight.double() @ x[t]
            shared = s.down_proj.weight.double() @ (torch.nn.functional.silu(g) * u)
            out[t] += torch.sigmoid(block.shared_expert_gate.weight.double() @ x[t]) * shared
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_block_matches_the_explicit_token_loop(tiny, random_model, family):
    model = random_model(tiny(**FAMILIES[family]))
    block = model.layers[0].mlp
    assert isinstance(block, SparseMoE)
    x = torch.randn(3, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(block(x).double().reshape(21, 32), _explicit(block, x), rtol=1e-5, atol=1e-5)


def test_training_signals(tiny, random_model):
    """Gradients reach the router (through the gating weights and the aux loss) and every used expert;
    the load-balancing loss is 1 when perfectly balanced; FLOPs count only the k active experts."""
    config = tiny(**FAMILIES["qwen2_moe"])
    model = random_model(config).train()
    ids = torch.randint(0, 97, (2, 16))
    model(ids).logsumexp(-1).mean().backward(retain_graph=True)  # the aux loss shares the router graph
    router = model.layers[0].mlp.gate.weight
    assert router.grad is not None and router.grad.abs().sum() > 0
    lm_grad = router.grad.clone()
    aux = model.router_aux_loss()
    assert aux is not None and aux.item() > 0
    aux.backward()
    assert not torch.equal(router.grad, lm_grad)
    metrics = model.router_metrics()
    assert metrics["moe/dropped"] == 0.0 and metrics["moe/imbalance"] >= 1.0
    assert metrics["moe/tokens_per_expert_max"] >= 32 * 2 / 5 >= metrics["moe/tokens_per_expert_min"]
    uniform = torch.full((10, 5), 0.2)
    balanced = torch.arange(20).view(10, 2) % 5  # every expert gets 4 of the 20 assignments
    assert load_balancing_loss(uniform, balanced, 5).item() == pytest.approx(2.0)  # = k when balanced
    dense = TransformerLM(tiny(arch="qwen2", qkv_bias=True), device="meta")
    moe = TransformerLM(config, device="meta")
    inactive = 6.0 * 2 * (5 - 2) * 3 * 32 * 24  # 6 FLOPs per weight x layers x unused experts x 3 [32, 24] matrices
    assert moe.flops_per_token(16) == pytest.approx(
        6.0 * moe.num_params(non_embedding=True) - inactive + 12.0 * 2 * 4 * 8 * 16)
    assert dense.router_aux_loss() is None and dense.router_metrics() == {}


def test_no_router_state_outside_training(tiny, random_model):
    model = random_model(tiny(**FAMILIES["mixtral"]))  # eval mode
    model(torch.randint(0, 97, (1, 5)))
    assert model.router_aux_loss() is None


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_packed_static_decode_steps_match_the_ordinary_forward(tiny, random_model, family):
    """pack_projections_ and static (graph-shaped) decode steps serve MoE models: the same logits as the
    ordinary cached forward, for the shared expert's packed gate/up and for OLMoE's projection QK-norm."""
    model = random_model(tiny(**FAMILIES[family]))
    model.pack_projections_()
    caches = [make_cache("paged", model.config, batch_size=2, max_seq_len=32, block_size=4) for _ in range(2)]
    prompts = torch.randint(0, 97, (2, 6))
    with torch.inference_mode():
        tokens = [model(prompts, cache=c, seq_ids=[0, 1])[:, -1].argmax(-1) for c in caches][0]
        decode = StaticDecode(caches[1], max_batch=2)
        for _ in range(3):
            want = model(tokens[:, None], cache=caches[0], seq_ids=[0, 1])[:, -1]
            decode.prepare([0, 1], tokens, bucket=2)
            ids, positions, step = decode.inputs(2)
            got = model(ids, position_ids=positions, kv_step=step)[:, -1]
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            tokens = want.argmax(-1)


def test_top_k_above_num_experts_is_refused(tiny):
    with pytest.raises(ValueError, match=r"`top_k` \(6\) exceeds `num_experts` \(5\).*moe.top_k"):
        tiny(moe=MoEConfig(num_experts=5, top_k=6))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_cuda_grouped_kernels_match_the_per_expert_loop(tiny, random_model, family):
    """On CUDA the registry picks the Triton kernels; the references (the per-expert loop) give the same
    logits and gradients, in bfloat16."""
    from plyx.kernel import query_for, registry

    model = random_model(tiny(**FAMILIES[family], dtype="bfloat16")).cuda().train()
    ids = torch.randint(0, 97, (3, 40), device="cuda")
    w = model.layers[0].mlp.experts.gate_up_proj
    assert registry().select("grouped_gemm", query_for("grouped_gemm", w, w)).impl == "triton"
    runs = []
    for override in ({}, {"moe_permute": "reference", "moe_unpermute": "reference", "grouped_gemm": "reference"}):
        model.zero_grad()
        with registry().override(**override):
            logits = model(ids)
            (logits.float().logsumexp(-1).mean() + model.router_aux_loss()).backward()
        runs.append((logits.float(), model.layers[0].mlp.experts.gate_up_proj.grad.float().clone()))
    torch.testing.assert_close(runs[0][0], runs[1][0], rtol=2e-2, atol=5e-2)
    torch.testing.assert_close(runs[0][1], runs[1][1], rtol=5e-2, atol=5e-3)


def test_autocast_runs_the_experts_in_the_autocast_dtype(tiny, random_model):
    """float32 parameters under bf16 autocast: the experts compute in bf16 (as F.linear would), gradients reach
    the float32 expert weights, and the result stays close to the float32 forward."""
    model = random_model(tiny(**FAMILIES["mixtral"])).train()
    ids = torch.randint(0, 97, (2, 8))
    want = model(ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model(ids)
    got.float().logsumexp(-1).mean().backward()
    experts = model.layers[0].mlp.experts
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad.dtype == torch.float32
    assert (got.float() - want).abs().max() < 0.1 * want.abs().max()
