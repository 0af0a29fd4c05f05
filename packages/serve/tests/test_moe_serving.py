"""The engine serves mixture-of-experts models: cached, paged and graph-shaped decode give the recompute path's tokens."""

from __future__ import annotations

import pytest
import torch
from plyx.attn import make_cache
from plyx.model import TransformerLM
from plyx.serve import SamplingParams, generate
from plyx.serve._graphs import DecodeGraphs
from plyx.specs import ModelConfig
from plyx.specs.config import MoEConfig

MOE = MoEConfig(num_experts=4, top_k=2, d_expert=32, norm_topk_prob=False, shared_expert_d_ff=32)


def _model() -> TransformerLM:
    torch.manual_seed(0)
    config = ModelConfig(arch="qwen2", qkv_bias=True, vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         d_ff=64, max_seq_len=64, moe=MOE)
    model = TransformerLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3).add_(1.0 if p.dim() == 1 else 0.0)
    return model.eval()


@pytest.mark.parametrize("cache", ["contiguous", "paged"])
def test_greedy_generation_matches_recompute(cache):
    model = _model()
    params = SamplingParams(temperature=0, max_new_tokens=6)
    prompts = [[3, 9, 4, 1, 7], [5, 2]]
    want = [o.outputs[0].token_ids for o in generate(model, prompts, params, use_cache=False)]
    got = [o.outputs[0].token_ids for o in generate(model, prompts, params, cache=cache)]
    assert got == want


def test_static_decode_steps_of_an_moe_model():
    """DecodeGraphs' static step (packed projections, eager on CPU) equals the ordinary cached forward."""
    model = _model()
    caches = [make_cache("paged", model.config, batch_size=2, max_seq_len=48, dtype=torch.float32) for _ in range(2)]
    ids = torch.tensor([[4, 8, 15, 16], [23, 42, 7, 1]])
    with torch.inference_mode():
        tokens = model(ids, cache=caches[0], seq_ids=[0, 1])[:, -1].argmax(-1)
        model(ids, cache=caches[1], seq_ids=[0, 1])
        graphs = DecodeGraphs(model, caches[1], max_batch=2, capture=False)
        for _ in range(4):
            want = model(tokens[:, None], cache=caches[0], seq_ids=[0, 1])[:, -1]
            torch.testing.assert_close(graphs.step([0, 1], tokens), want, rtol=1e-5, atol=1e-5)
            tokens = want.argmax(-1)
