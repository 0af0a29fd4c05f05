"""The Trainer with plyx-model's adapters: NEFTune as a config option, and a LoRA model trained through it."""

from __future__ import annotations

from pathlib import Path

import pytest
from plyx.model import TransformerLM
from plyx.model.adapters import LoraConfig, adapter_state_dict, add_adapter, mark_only_adapters_trainable
from plyx.specs import ConfigError, TrainConfig
from plyx.train import Trainer, TrainOptions

QUIET = {"progress": False, "tensorboard": False}


def test_neftune_option_adds_noise_in_training_only(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=3, eval_every=3, checkpoint_every=0, neftune_alpha=5.0)
    trainer = Trainer(cfg, options=TrainOptions(**QUIET))
    assert trainer.neftune.alpha == 5.0 and trainer.neftune.module is trainer.module.embed_tokens
    result = trainer.fit()
    assert all(loss == loss for loss in result.losses) and "val_loss" in result.metrics
    plain = Trainer(tiny_config(prepared, tmp_path / "plain", steps=3, eval_every=3, checkpoint_every=0),
                    options=TrainOptions(**QUIET))
    assert not hasattr(plain, "neftune")
    # the same seed and data: training differs (noise), evaluation of the same weights would not
    assert plain.fit().losses[0] != result.losses[0]


def test_neftune_alpha_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="neftune_alpha"):
        TrainConfig.from_dict({"neftune_alpha": 0.0})


def test_a_lora_model_trains_through_the_trainer(tiny_config, prepared: Path, tmp_path: Path) -> None:
    # activation checkpointing (non-reentrant) still reaches the adapters behind the frozen embedding
    cfg = tiny_config(prepared, tmp_path / "run", steps=12, eval_every=0, checkpoint_every=0,
                      optimizer={"lr": 3e-2, "weight_decay": 0.0}, activation_checkpointing=True)
    model = TransformerLM(cfg.model)
    add_adapter(model, LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj")))
    mark_only_adapters_trainable(model)
    base = {k: v.clone() for k, v in model.state_dict().items() if "lora" not in k}
    before = {k: v.clone() for k, v in adapter_state_dict(model).items()}
    result = Trainer(cfg, model=model, options=TrainOptions(**QUIET)).fit()
    assert result.losses[-1] < result.losses[0]
    assert all((model.state_dict()[k] == v).all() for k, v in base.items())  # the base stays frozen
    assert any(not (adapter_state_dict(model)[k] == v).all() for k, v in before.items())


def test_resume_of_a_lora_run_is_bitwise_exact(tiny_config, prepared: Path, tmp_path: Path) -> None:
    """6 steps in one go == 3 steps, a checkpoint (base + ``lora_*`` tensors), a fresh adapted model resumed for 3.

    The resumed model starts from other random adapter values (built after another RNG draw), so equality
    proves that the checkpoint's adapter tensors, optimizer moments and data position were all restored.
    """
    import torch

    cfg = tiny_config(prepared, tmp_path / "run", steps=6, eval_every=0, checkpoint_every=3, sample_tokens=0,
                      optimizer={"lr": 3e-2, "weight_decay": 0.0})
    lora = LoraConfig(r=4, alpha=8, target_modules=("q_proj", "v_proj", "up_proj"))

    def adapted(seed: int) -> TransformerLM:
        torch.manual_seed(seed)
        model = TransformerLM(cfg.model)
        add_adapter(model, lora)
        mark_only_adapters_trainable(model)
        return model

    whole = adapted(0)
    result = Trainer(cfg, model=whole, options=TrainOptions(**QUIET)).fit()
    ckpt = tmp_path / "run" / "checkpoints" / "step-000003"
    resumed_model = adapted(1)
    resumed = Trainer(cfg.replace(out_dir=str(tmp_path / "resumed")), model=resumed_model,
                      options=TrainOptions(resume=str(ckpt), **QUIET))
    assert resumed.step == 3
    again = resumed.fit()
    assert again.losses == result.losses[3:]  # exact floats, not approx
    want, got = whole.state_dict(), resumed_model.state_dict()
    assert want.keys() == got.keys() and any("lora_A" in k for k in want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
