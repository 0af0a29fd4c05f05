"""``adafactor``: the optimizer plugin is torch's Adafactor over plyx's parameter groups; its state is factored
(row and column statistics per matrix), the memory plan counts it, and it trains the tiny model."""

from __future__ import annotations

from pathlib import Path

import torch
from plyx.specs import OptimizerConfig
from plyx.train import Trainer, TrainOptions
from plyx.train._memory import OPTIMIZER_STATE_BYTES
from plyx.train._optim import build_optimizer

QUIET = {"progress": False, "tensorboard": False}


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim())


def test_plugin_is_torch_adafactor_over_the_decay_groups() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256))
    opt = build_optimizer(model, OptimizerConfig(name="adafactor", lr=1e-2, weight_decay=0.05))
    assert type(opt) is torch.optim.Adafactor
    decay = {g["group"]: g["weight_decay"] for g in opt.param_groups}
    assert decay == {"decay": 0.05, "no_decay": 0.0}  # no decay on norm gains and biases
    assert all(g["lr"] == 1e-2 for g in opt.param_groups)


def test_state_is_factored_and_counted_by_the_plan() -> None:
    w = torch.nn.Parameter(torch.randn(256, 64))
    b = torch.nn.Parameter(torch.randn(64))
    opt = build_optimizer(torch.nn.ParameterList([w, b]), OptimizerConfig(name="adafactor", lr=1e-2))
    (w.square().sum() + b.sum()).backward()
    opt.step()
    assert opt.state[w]["row_var"].shape == (256, 1) and opt.state[w]["col_var"].shape == (1, 64)
    assert opt.state[b]["variance"].shape == (64,)  # a vector keeps its full second moment
    ref = torch.optim.AdamW([w, b], lr=1e-3)
    ref.step()
    # (256 + 64 + 64) float32 values against AdamW's 2 x (256 x 64 + 64)
    assert _state_bytes(opt) == 4 * (256 + 64 + 64) and _state_bytes(ref) == 8 * (256 * 64 + 64)
    params = w.numel() + b.numel()
    assert _state_bytes(opt) <= OPTIMIZER_STATE_BYTES["adafactor"] * params  # the plan's bound holds


def test_trains_the_tiny_model(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "adafactor", steps=30, eval_every=0, checkpoint_every=0, sample_tokens=0,
                      log_every=10, optimizer={"name": "adafactor", "lr": 3e-2},
                      model={"d_model": 64, "d_ff": 128, "n_heads": 4})
    trainer = Trainer(cfg, options=TrainOptions(**QUIET))
    losses = torch.tensor(trainer.fit().losses)
    assert type(trainer.optimizer) is torch.optim.Adafactor
    assert losses[-5:].mean() < 0.9 * losses[:3].mean(), losses.tolist()
