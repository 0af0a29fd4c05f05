"""Hugging Face interop of the MoE families with ``transformers`` itself: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE.

Tiny random models built by transformers -> save_pretrained (one tensor per expert on disk) -> plyx
load: logits of a prefill and of cached decode steps match; plyx -> save_hf -> transformers
from_pretrained: the same logits. float32, tight tolerance. Plus the router's load-balancing loss
against transformers' ``load_balancing_loss_func``, and bad checkpoints named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plyx.attn import make_cache  # noqa: E402
from plyx.model import CheckpointError, load_checkpoint, load_hf, open_checkpoint, save_hf  # noqa: E402

COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=48, vocab_size=67, max_position_embeddings=64)
CASES = {
    "mixtral": ("MixtralConfig", dict(num_local_experts=5, num_experts_per_tok=2)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=24,
                                         shared_expert_intermediate_size=40)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24, head_dim=16,
                                         norm_topk_prob=True)),
    "olmoe": ("OlmoeConfig", dict(num_experts=4, num_experts_per_tok=2, pad_token_id=1, eos_token_id=2)),
}
ARCH = {"mixtral": "mistral", "qwen2_moe": "qwen2", "qwen3_moe": "qwen3", "olmoe": "llama"}
TOL = dict(rtol=1e-5, atol=1e-5)


def hf_model(case: str):
    cls_name, extra = CASES[case]
    config = getattr(transformers, cls_name)(**{**COMMON, **extra})
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2).add_(1.0 if p.dim() == 1 else 0.0)  # norms near 1
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, tuple[object, Path]]:
    out = {}
    for case in CASES:
        model = hf_model(case)
        path = tmp_path_factory.mktemp(case)
        model.save_pretrained(path)
        out[case] = (model, path)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_load_transformers_moe_prefill_and_decode(saved, case: str) -> None:
    hf, path = saved[case]
    assert not any(".experts.1." in n for n in open_checkpoint(path).card.tensors)  # folded into stacked entries
    model = load_checkpoint(path)
    c = model.config
    experts = CASES[case][1].get("num_local_experts") or CASES[case][1]["num_experts"]
    assert (c.arch, c.moe.num_experts, c.moe.top_k) == (ARCH[case], experts, CASES[case][1]["num_experts_per_tok"])
    assert c.moe.norm_topk_prob == (case in ("mixtral", "qwen3_moe"))
    assert (c.moe.shared_expert_d_ff is not None) == (case == "qwen2_moe")
    ids = torch.randint(0, 67, (2, 12))
    with torch.no_grad():
        want = hf(ids).logits
        torch.testing.assert_close(model(ids), want, **TOL)
        cache = make_cache("paged", c, batch_size=2, block_size=4)
        steps = [model(ids[:, :5], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(5, 12)]
        torch.testing.assert_close(torch.cat(steps, 1), want, **TOL)


@pytest.mark.parametrize("case", list(CASES))
def test_save_hf_loads_in_transformers(saved, tmp_path: Path, case: str) -> None:
    hf, path = saved[case]
    model = load_hf(path)
    out = save_hf(model, tmp_path / "export")
    on_disk = set(open_checkpoint(out).card.tensors)
    assert "model.layers.1.mlp.experts.gate_up_proj" in on_disk  # folded back on reading
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(reloaded).__name__ == type(hf).__name__
    ids = torch.randint(0, 67, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, hf(ids).logits, **TOL)
    assert load_hf(out).config == model.config


def test_load_balancing_loss_matches_transformers(saved) -> None:
    """Per layer, plyx's Switch/Mixtral loss equals transformers' load_balancing_loss_func on the same logits."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    hf, path = saved["mixtral"]
    model = load_checkpoint(path).train()
    ids = torch.randint(0, 67, (2, 9))
    out = hf(ids, output_router_logits=True)
    model(ids)
    moe = model.config.moe
    layers = [layer.mlp for layer in model.layers]
    states = [m.router_state for m in layers]
    for state, logits in zip(states, out.router_logits):
        want = load_balancing_loss_func((logits,), moe.num_experts, moe.top_k)
        torch.testing.assert_close(state[0], want.float(), rtol=1e-5, atol=1e-6)
        z = torch.logsumexp(logits.float(), -1).square().mean()  # ST-MoE eq. 5
        torch.testing.assert_close(state[1], z, rtol=1e-5, atol=1e-6)
    aux = model.router_aux_loss()
    torch.testing.assert_close(aux, moe.aux_loss_coef * torch.stack([s[0] for s in states]).mean())
    assert all(m.router_state is None for m in layers) and model.router_aux_loss() is None  # consumed once


def _copy(src: Path, dst: Path) -> None:
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())


def test_missing_expert_tensor_is_named(saved, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    _, src = saved["olmoe"]
    _copy(src, tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing expert tensors 'model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight'"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize(("changes", "match"), [
    ({"mlp_only_layers": [0]}, "mlp_only_layers.*supported: mlp_only_layers = \\[\\]"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"scoring_func": "sigmoid"}, "scoring_func.*supported routing: softmax top-k"),
    ({"num_experts_per_tok": 9}, "`top_k` \\(9\\) exceeds `num_experts` \\(5\\)"),
])
def test_unsupported_routing_variants_are_named(saved, tmp_path: Path, changes, match) -> None:
    _, src = saved["qwen2_moe"]
    _copy(src, tmp_path)
    doc = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**doc, **changes}))
    with pytest.raises(Exception, match=match):
        open_checkpoint(tmp_path)


def test_save_hf_refuses_moe_transformers_cannot_express(tmp_path: Path, tiny) -> None:
    from plyx.model import TransformerLM
    from plyx.specs.config import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2)
    for overrides, match in [
        (dict(arch="llama", moe=moe), "no Llama mixture of experts"),
        (dict(arch="mistral", moe=MoEConfig(num_experts=4, top_k=2, norm_topk_prob=False)), "Mixtral always renormalises"),
        (dict(arch="qwen2", qkv_bias=True, moe=moe), "shared expert exists exactly in Qwen2-MoE"),
        (dict(arch="qwen3", qk_norm=True, qk_norm_scope="projection"), "exists only in OLMoE"),
    ]:
        with pytest.raises(CheckpointError, match=match):
            save_hf(TransformerLM(tiny(**overrides)), tmp_path / "x")
        assert not (tmp_path / "x").exists()


def test_layer_streaming_reads_stacked_experts_per_layer(saved) -> None:
    from plyx.model import LayerStreamer

    hf, path = saved["mixtral"]
    ids = torch.randint(0, 67, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(LayerStreamer(path)(ids), hf(ids).logits, **TOL)


def test_sharded_moe_checkpoint_stacks_experts_across_shards(tmp_path: Path) -> None:
    hf = hf_model("qwen3_moe")
    hf.save_pretrained(tmp_path, max_shard_size="20KB")
    ckpt = open_checkpoint(tmp_path)
    assert len(ckpt.shards()) > 2
    entries = ckpt.card.tensors  # a stacked entry names the shard of its first part
    assert entries["model.layers.0.mlp.experts.down_proj"].shard == ckpt._composites["layers.0.mlp.experts.down_proj"].parts[0][0][0]
    ckpt.verify()  # every shard an expert tensor lives in is checked, not only the first part's
    ids = torch.randint(0, 67, (1, 7))
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path)(ids), hf(ids).logits, **TOL)
