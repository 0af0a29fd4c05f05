from __future__ import annotations

import pytest
import torch
from plyx.model import TransformerLM
from plyx.specs import Component, ModelConfig, OptimizerConfig, hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin
from plyx.train import available_optimizers, build_optimizer, param_groups


def _model() -> TransformerLM:
    return TransformerLM(ModelConfig(arch="qwen2", vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32,
                                     qkv_bias=True, max_seq_len=16))


def test_no_decay_on_norms_and_biases() -> None:
    model = _model()
    groups = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = {names[id(p)] for p in groups[0]["params"]}
    no_decay = {names[id(p)] for p in groups[1]["params"]}
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0
    assert all(n.endswith(("norm.weight", ".bias")) for n in no_decay)
    assert any(n.endswith("q_proj.bias") for n in no_decay) and any("layernorm" in n for n in no_decay)
    assert "embed_tokens.weight" in decay and all(model.get_parameter(n).ndim == 2 for n in decay)
    assert decay | no_decay == set(names.values())


def test_builtin_optimizers_and_fused_adamw() -> None:
    assert {"adamw", "sgd"} <= set(available_optimizers())
    opt = build_optimizer(_model(), OptimizerConfig(name="adamw", lr=1e-3, betas=(0.9, 0.99)))
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"] is True  # torch has a fused CPU kernel
    assert opt.param_groups[0]["betas"] == (0.9, 0.99)
    sgd = build_optimizer(_model(), OptimizerConfig(name="sgd", lr=0.1))
    assert isinstance(sgd, torch.optim.SGD) and sgd.defaults["nesterov"]


def test_unknown_optimizer_lists_the_known_ones() -> None:
    with pytest.raises(LookupError, match=r"'adamx' not found.*available: .*adamw.*sgd"):
        build_optimizer(_model(), OptimizerConfig(name="adamx"))


class _ThirdParty:
    @hookimpl
    def plyx_optimizers(self) -> list:
        def factory(groups, config):
            return torch.optim.Adagrad(groups, lr=config.lr)

        return [Component("adagrad", factory, "a third party's optimizer")]


def test_third_party_optimizer_through_the_hook() -> None:
    register_plugin(_ThirdParty(), "test-adagrad")
    try:
        opt = build_optimizer(_model(), OptimizerConfig(name="adagrad", lr=0.05))
        assert isinstance(opt, torch.optim.Adagrad) and opt.param_groups[0]["lr"] == 0.05
    finally:
        unregister_plugin("test-adagrad")
