"""An MoE model trains: router losses join the loss, router statistics reach metrics.csv, exact resume holds."""

from __future__ import annotations

import csv
import os
import signal
from pathlib import Path

import torch
from plyx.specs import hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin
from plyx.train import Trainer, TrainOptions
from safetensors.torch import load_file

QUIET = {"progress": False, "tensorboard": False}
MOE = {"arch": "qwen2", "qkv_bias": True,
       "moe": {"num_experts": 4, "top_k": 2, "d_expert": 32, "shared_expert_d_ff": 32, "z_loss_coef": 1e-3}}


class _StopAt:
    """Sends SIGTERM at the end of one step (the trainer checkpoints and stops, as on a preemption)."""

    def __init__(self, step: int) -> None:
        self.step = step

    @hookimpl
    def plyx_on_train_step_end(self, step: int, metrics: dict) -> None:
        if step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def test_moe_trains_reports_router_metrics_and_resumes_exactly(tiny_config, prepared: Path, tmp_path: Path) -> None:
    n = 3
    cfg = tiny_config(prepared, tmp_path / "straight", steps=2 * n, checkpoint_every=0, eval_every=0, log_every=1,
                      model=MOE)
    straight = Trainer(cfg, options=TrainOptions(**QUIET)).fit()
    with open(tmp_path / "straight" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 * n
    for row in rows:  # every logged step has the router's statistics
        assert float(row["moe/lb_loss"]) >= 1.9 and float(row["moe/imbalance"]) >= 1.0  # E * sum f P >= k
        assert float(row["moe/dropped"]) == 0.0
        assert float(row["moe/tokens_per_expert_min"]) <= 4 * 16 * 2 / 4 <= float(row["moe/tokens_per_expert_max"])

    killed_cfg = cfg.replace(out_dir=str(tmp_path / "killed"))
    register_plugin(_StopAt(n), "test-moe-stop")
    try:
        first = Trainer(killed_cfg, options=TrainOptions(**QUIET)).fit()
    finally:
        unregister_plugin("test-moe-stop")
    assert first.stopped == "SIGTERM" and first.step == n
    second = Trainer(killed_cfg, options=TrainOptions(resume="auto", **QUIET)).fit()
    assert first.losses + second.losses == straight.losses  # exact float equality, router losses included
    a = load_file(str(straight.checkpoint / "model.safetensors"))
    b = load_file(str(second.checkpoint / "model.safetensors"))
    assert "layers.0.mlp.experts.gate_up_proj" in a
    for name in a:
        assert torch.equal(a[name], b[name]), name
