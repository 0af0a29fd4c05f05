"""The Trainer end to end on a tiny model: exact resume, NaN stops, hooks, metrics, bad input."""

from __future__ import annotations

import csv
import math
import os
import shutil
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from plyx.model import load_checkpoint
from plyx.specs import ConfigError, hookimpl
from plyx.specs.plugins import register_plugin, unregister_plugin
from plyx.train import (
    NonFiniteLossError,
    ResumeError,
    ShardError,
    Trainer,
    TrainOptions,
    prepare_corpus,
    spectral_ratios,
)
from plyx.train._metrics import layer_groups
from safetensors.torch import load_file

QUIET = {"progress": False, "tensorboard": False}


class _Plugin:
    """Registers hook implementations for one test and records what they saw."""

    def __init__(self, **impls: Any) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.impls = impls

    @hookimpl
    def plyx_on_train_step_end(self, step: int, metrics: dict) -> None:
        self.calls.append(("step", {"step": step, "metrics": dict(metrics)}))
        if "step_end" in self.impls:
            self.impls["step_end"](step)

    @hookimpl
    def plyx_on_checkpoint_saved(self, path: str, step: int, metadata: dict) -> None:
        self.calls.append(("checkpoint", {"path": path, "step": step, "metadata": metadata}))

    @hookimpl
    def plyx_on_train_end(self, out_dir: str, metrics: dict, metadata: dict) -> None:
        self.calls.append(("end", {"out_dir": out_dir, "metrics": metrics, "metadata": metadata}))


class _registered:
    def __init__(self, plugin: _Plugin) -> None:
        self.plugin = plugin

    def __enter__(self) -> _Plugin:
        register_plugin(self.plugin, "test-train-hooks")
        return self.plugin

    def __exit__(self, *exc: object) -> None:
        unregister_plugin("test-train-hooks")


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


def test_exact_resume_after_sigterm(tiny_config, prepared: Path, tmp_path: Path) -> None:
    """2N steps straight == N steps, SIGTERM, resume for N more: bitwise, losses and weights."""
    n = 4
    cfg = tiny_config(prepared, tmp_path / "straight", steps=2 * n, checkpoint_every=0, eval_every=3)
    straight = Trainer(cfg, options=TrainOptions(**QUIET)).fit()

    killed_cfg = cfg.replace(out_dir=str(tmp_path / "killed"))
    kill = _Plugin(step_end=lambda step: step == n and os.kill(os.getpid(), signal.SIGTERM))
    with _registered(kill):
        first = Trainer(killed_cfg, options=TrainOptions(**QUIET)).fit()
    assert first.stopped == "SIGTERM" and first.step == n
    assert first.checkpoint is not None and first.checkpoint.name == f"step-{n:06d}"
    second = Trainer(killed_cfg, options=TrainOptions(resume="auto", **QUIET)).fit()
    assert second.step == 2 * n and second.stopped is None

    assert first.losses + second.losses == straight.losses  # exact float equality
    a, b = _weights(straight.checkpoint), _weights(second.checkpoint)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    opt_a = load_file(str(straight.checkpoint / "trainer_state.safetensors"))
    opt_b = load_file(str(second.checkpoint / "trainer_state.safetensors"))
    for name in opt_a:
        assert torch.equal(opt_a[name], opt_b[name]), name
    # the metrics file of the resumed run reads as one run
    with open(tmp_path / "killed" / "metrics.csv") as fh:
        steps = [int(r["step"]) for r in csv.DictReader(fh)]
    assert steps == sorted(set(steps)) and steps[-1] == 2 * n


def test_training_lowers_the_loss_and_writes_a_servable_checkpoint(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=30, eval_every=30, checkpoint_every=0,
                      optimizer={"lr": 1e-2}, schedule={"warmup_steps": 3})
    result = Trainer(cfg, options=TrainOptions(progress=False, tensorboard=True)).fit()
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 0.5
    assert result.metrics["val_ppl"] == pytest.approx(math.exp(result.metrics["val_loss"]))
    assert result.sample  # decoded text
    model = load_checkpoint(result.checkpoint)  # plyx-model reads it as a plain model checkpoint
    assert model.config == cfg.model
    assert (result.checkpoint / "tokenizer.json").is_file()
    with open(tmp_path / "run" / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in rows] == list(range(2, 31, 2))
    assert {"grad_norm/layers.0", "grad_norm/layers.1", "tokens_per_s", "peak_mem_mb"} <= set(rows[0])
    assert float(rows[0]["grad_norm/layers.1"]) > 0 and rows[-1]["val_loss"]
    if shutil.which("python") and _has_tensorboard():
        assert any((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def _has_tensorboard() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def test_hooks_fire_with_governance_metadata(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=4, checkpoint_every=2, eval_every=0)
    with _registered(_Plugin()) as plugin:
        result = Trainer(cfg, options=TrainOptions(**QUIET)).fit()
    kinds = [k for k, _ in plugin.calls]
    assert kinds == ["step", "step", "checkpoint", "step", "step", "checkpoint", "end"]
    assert [c["step"] for k, c in plugin.calls if k == "step"] == [1, 2, 3, 4]
    saved = [c for k, c in plugin.calls if k == "checkpoint"]
    assert [c["step"] for c in saved] == [2, 4] and saved[-1]["path"] == str(result.checkpoint)
    meta = saved[-1]["metadata"]
    assert {"config", "seeds", "inputs", "outputs", "metrics", "run_id"} <= set(meta)
    assert meta["config"]["model"]["d_model"] == 32 and meta["seeds"]["seed"] == cfg.seed
    assert Path(meta["inputs"]["tokenizer"]).is_file() and Path(meta["inputs"]["manifest"]).is_file()
    assert meta["outputs"]["checkpoint"] == str(result.checkpoint)
    end = plugin.calls[-1][1]
    assert end["out_dir"] == str(tmp_path / "run") and end["metadata"]["run_id"] == meta["run_id"]


def test_nan_stops_with_step_and_batch_named_and_checkpoint_intact(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=8, checkpoint_every=2, eval_every=0, grad_accum=2)
    holder: dict[str, Trainer] = {}

    def poison(step: int) -> None:
        if step == 3:  # after step 3 (no checkpoint at 3), a weight goes NaN: step 4's loss is NaN
            with torch.no_grad():
                holder["t"].module.lm_head_weight[0, 0] = float("nan")

    trainer = Trainer(cfg, options=TrainOptions(**QUIET))
    holder["t"] = trainer
    with _registered(_Plugin(step_end=poison)), pytest.raises(NonFiniteLossError) as info:
        trainer.fit()
    err = info.value
    assert err.step == 4 and err.what == "loss"
    assert err.batch["index"] == 6  # step 4's first micro-batch (2 per step)
    assert "step 4" in str(err) and "batch 6 of split 'train'" in str(err)
    good = tmp_path / "run" / "checkpoints" / "step-000002"
    assert err.checkpoint == good and (tmp_path / "run" / "checkpoints" / "latest").resolve() == good
    assert all(torch.isfinite(t).all() for t in _weights(good).values())
    assert not (tmp_path / "run" / "checkpoints" / "step-000004").exists()


def test_activation_checkpointing_and_packed_documents(tiny_config, prepared: Path, tmp_path: Path) -> None:
    base = tiny_config(prepared, tmp_path / "a", steps=3, eval_every=0, checkpoint_every=0,
                       data={"mode": "packed"})
    plain = Trainer(base, options=TrainOptions(**QUIET)).fit()
    ckpt = Trainer(base.replace(out_dir=str(tmp_path / "b"), activation_checkpointing=True),
                   options=TrainOptions(**QUIET))
    assert ckpt.ckpt_layers == 2
    recomputed = ckpt.fit()
    # recomputing the layers in the backward pass changes memory, not the math
    assert recomputed.losses == pytest.approx(plain.losses, rel=1e-6, abs=1e-6)


def test_bf16_autocast_trains(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=3, eval_every=3, checkpoint_every=0,
                      precision="bf16-autocast")
    fp32 = Trainer(cfg.replace(precision="float32", out_dir=str(tmp_path / "fp32")), options=TrainOptions(**QUIET)).fit()
    bf16 = Trainer(cfg, options=TrainOptions(**QUIET)).fit()
    assert all(math.isfinite(x) for x in bf16.losses)
    assert bf16.losses[0] == pytest.approx(fp32.losses[0], abs=0.05)  # bf16 rounding, same data and init


def test_spectral_probe(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=2, eval_every=0, checkpoint_every=0, log_every=1)
    lines: list[str] = []
    trainer = Trainer(cfg, options=TrainOptions(progress=False, tensorboard=False, spectral_probe_every=1,
                                                print_fn=lines.append))
    with torch.no_grad():
        for p in trainer.module.layers[1].mlp.parameters():
            p.mul_(20.0)  # layer 1's MLP dwarfs its attention
    groups = layer_groups(trainer.module)
    ratios = spectral_ratios(groups)
    layer = trainer.module.layers[0]
    mlp = torch.stack([torch.linalg.matrix_norm(p, ord=2) for p in layer.mlp.parameters()]).mean()
    attn = torch.stack([torch.linalg.matrix_norm(p, ord=2) for p in layer.self_attn.parameters() if p.ndim == 2]).mean()
    assert ratios["layers.0"] == pytest.approx(float(mlp.detach() / attn.detach()), rel=1e-5)
    assert ratios["layers.1"] > 2.0
    result = trainer.fit()
    assert "spectral_ratio/layers.1" in result.metrics
    assert any("layers.1 MLP/attention spectral-norm ratio" in line for line in lines)


# -- bad input: a clear error before any step ---------------------------------------------
def _no_step_ran(out: Path) -> bool:
    return not (out / "checkpoints").exists() and not (out / "metrics.csv").exists()


def test_corrupt_or_missing_shard(tiny_config, prepared: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    shutil.copytree(prepared, data)
    shard = data / "train-00000.bin"
    raw = bytearray(shard.read_bytes())
    raw[5] ^= 1
    shard.write_bytes(bytes(raw))
    with pytest.raises(ShardError, match="train-00000.bin.*sha256"):
        Trainer(tiny_config(data, tmp_path / "run"), options=TrainOptions(**QUIET))
    shard.unlink()
    with pytest.raises(ShardError, match="missing"):
        Trainer(tiny_config(data, tmp_path / "run"), options=TrainOptions(**QUIET))
    assert _no_step_ran(tmp_path / "run")


def test_tokenizer_and_vocab_mismatch(tiny_config, prepared: Path, corpus: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"use 300 - at `\$.model.vocab_size` \(got 100\); set model.vocab_size >= 300"):
        Trainer(tiny_config(prepared, tmp_path / "run", model={"vocab_size": 100}), options=TrainOptions(**QUIET))
    other = tmp_path / "other"
    prepare_corpus(corpus, other, vocab_size=280, val_fraction=0.2, use_hooks=False)
    with pytest.raises(ConfigError, match=r"not the one the shards .* at `\$.data.tokenizer`"):
        Trainer(tiny_config(prepared, tmp_path / "run", data={"tokenizer": str(other / "tokenizer.json")}),
                options=TrainOptions(**QUIET))
    assert _no_step_ran(tmp_path / "run")


def test_impossible_batch_and_memory(tiny_config, prepared: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"batch_size=4 x data.seq_len=16.*MiB.*weights and optimizer states alone do not fit"):
        Trainer(tiny_config(prepared, tmp_path / "run"), options=TrainOptions(memory_bytes=1 << 16, **QUIET))
    with pytest.raises(ConfigError, match="max_seq_len"):
        tiny_config(prepared, tmp_path / "run", data={"seq_len": 64})
    with pytest.raises(ShardError, match="too few for one sequence"):
        Trainer(tiny_config(prepared, tmp_path / "run", data={"seq_len": 30000}, model={"max_seq_len": 30000}),
                options=TrainOptions(**QUIET))
    assert _no_step_ran(tmp_path / "run")


def test_resume_from_another_model_or_over_an_old_run(tiny_config, prepared: Path, tmp_path: Path) -> None:
    cfg = tiny_config(prepared, tmp_path / "run", steps=2, eval_every=0)
    Trainer(cfg, options=TrainOptions(**QUIET)).fit()
    bigger = tiny_config(prepared, tmp_path / "other", steps=2, eval_every=0, model={"d_model": 48})
    with pytest.raises(ResumeError, match=r"another model \(d_model: 32 in the checkpoint vs 48 here\)"):
        Trainer(bigger, options=TrainOptions(resume=str(tmp_path / "run"), **QUIET))
    with pytest.raises(ResumeError, match="already holds checkpoints.*resume"):
        Trainer(cfg, options=TrainOptions(**QUIET))
    with pytest.raises(ResumeError, match="no resumable checkpoint"):
        Trainer(cfg, options=TrainOptions(resume=str(tmp_path / "nothing"), **QUIET))
    with pytest.raises(ResumeError, match="data stream had batch_size=4"):
        Trainer(cfg.replace(batch_size=2), options=TrainOptions(resume="auto", **QUIET))


def test_raw_corpus_path_is_prepared_into_the_run(tiny_config, corpus: Path, tmp_path: Path) -> None:
    cfg = tiny_config(corpus, tmp_path / "run", steps=2, eval_every=0, checkpoint_every=0)
    trainer = Trainer(cfg, options=TrainOptions(**QUIET))
    assert trainer.data_dir == tmp_path / "run" / "data"
    assert trainer.tokenizer is not None and trainer.tokenizer.vocab_size <= 300
    assert trainer.fit().step == 2
