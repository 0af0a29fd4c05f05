"""Deferred step statistics (``TrainOptions.async_stats``, on by default on CUDA): no host sync inside the step,
and the same losses, hooks, metrics and NaN stop as reading them at once. Forced on here, on CPU."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from plyx.specs import hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin
from plyx.train import NonFiniteLossError, Trainer, TrainOptions
from plyx.train._step_stats import StepStats, skip_update

QUIET = {"progress": False, "tensorboard": False}


class _Steps:
    def __init__(self, poison=None) -> None:
        self.seen: list[tuple[int, dict]] = []
        self.poison = poison

    @hookimpl
    def plyx_on_train_step_end(self, step: int, metrics: dict) -> None:
        self.seen.append((step, dict(metrics)))
        if self.poison is not None:
            self.poison(step)


def _run(cfg, async_stats: bool, plugin: _Steps) -> Trainer:
    register_plugin(plugin, "test-step-stats")
    try:
        trainer = Trainer(cfg, options=TrainOptions(async_stats=async_stats, **QUIET))
        trainer.result = trainer.fit()
    finally:
        unregister_plugin("test-step-stats")
    return trainer


def test_deferred_stats_give_the_same_run(tiny_config, prepared: Path, tmp_path: Path) -> None:
    runs = {}
    for deferred in (False, True):
        cfg = tiny_config(prepared, tmp_path / f"run-{deferred}", steps=7, log_every=3, eval_every=4,
                          checkpoint_every=0, sample_tokens=0)
        plugin = _Steps()
        trainer = _run(cfg, deferred, plugin)
        with (tmp_path / f"run-{deferred}" / "metrics.csv").open() as f:
            rows = [{k: v for k, v in r.items() if k not in ("ms_per_step", "tokens_per_s", "mfu", "peak_mem_mb")}
                    for r in csv.DictReader(f)]
        runs[deferred] = (trainer.result.losses, plugin.seen, rows)
    (sync_losses, sync_seen, sync_rows), (async_losses, async_seen, async_rows) = runs[False], runs[True]
    assert async_losses == sync_losses and len(async_losses) == 7
    assert [s for s, _ in async_seen] == list(range(1, 8))  # every step's hook, in order
    for (_, a), (_, b) in zip(async_seen, sync_seen, strict=True):
        assert {k: a[k] for k in ("loss", "grad_norm", "lr", "tokens")} == {k: b[k] for k in ("loss", "grad_norm", "lr", "tokens")}
    assert async_rows == sync_rows and [r["step"] for r in async_rows] == ["3", "4", "6", "7"]


def test_deferred_nan_is_skipped_on_the_device_and_reported(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=8, checkpoint_every=0, eval_every=0, log_every=100)
    holder: dict[str, Trainer] = {}
    snapshot: dict[str, torch.Tensor] = {}

    def poison(step: int) -> None:  # runs for step 2 while step 3 is already done (one step late)
        if step == 2:
            t = holder["t"]
            with torch.no_grad():
                t.module.lm_head_weight[0, 0] = float("nan")
            snapshot.update({k: v.clone() for k, v in t.module.state_dict().items()})

    register_plugin(_Steps(poison), "test-step-stats")
    try:
        trainer = Trainer(cfg, options=TrainOptions(async_stats=True, **QUIET))
        holder["t"] = trainer
        with pytest.raises(NonFiniteLossError) as info:
            trainer.fit()
    finally:
        unregister_plugin("test-step-stats")
    assert info.value.step == 4 and info.value.what == "loss"  # the first step that read the NaN weight
    # step 4's update was skipped on the device: the weights are those the poison left (after step 3's update)
    for name, value in trainer.module.state_dict().items():
        torch.testing.assert_close(value, snapshot[name], equal_nan=True, msg=name)


def test_skip_update_and_the_queue() -> None:
    p = torch.nn.Parameter(torch.ones(3))
    fused = torch.optim.AdamW([p], lr=0.1, fused=True)
    p.grad = torch.ones(3)
    assert skip_update(fused, torch.tensor(1.0), torch.tensor(float("inf")))
    fused.step()
    assert torch.equal(p.detach(), torch.ones(3)) and fused.state[p]["step"].item() == 0
    assert skip_update(fused, torch.tensor(1.0), torch.tensor(2.0))
    fused.step()
    assert not torch.equal(p.detach(), torch.ones(3))
    assert not skip_update(torch.optim.AdamW([p], foreach=True), torch.tensor(1.0), torch.tensor(1.0))

    stats = StepStats(torch.device("cpu"), lookahead=1)
    stats.push(1, torch.tensor(2.5), torch.tensor(0.5), lr=1.0)
    assert list(stats.ready()) == []  # step 1 stays in flight until step 2 is queued
    stats.push(2, torch.tensor(2.0), torch.tensor(0.25), lr=1.0)
    assert [(p.step, p.read()) for p in stats.ready()] == [(1, (2.5, 0.5))]
    assert [(p.step, p.read()) for p in stats.ready(flush=True)] == [(2, (2.0, 0.25))] and not len(stats)
