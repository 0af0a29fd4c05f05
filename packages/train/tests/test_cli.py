"""``plyx data`` and ``plyx train`` through the real ``plyx`` entry point (plyx.specs.cli.main)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from plyx.specs import TrainConfig, dump_config
from plyx.specs.cli import main
from plyx.train import ShardSet, default_config
from plyx.train._cli import apply_overrides


def test_commands_are_contributed_by_the_plugin() -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


def test_data_prepare_and_inspect(corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data"
    code = main(["data", "prepare", str(corpus), "--out", str(out), "--vocab-size", "290", "--separator", "\\n\\n",
                 "--no-hooks"])
    assert code == 0
    text = capsys.readouterr().out
    assert "prepared 120 documents" in text and "vocab 290" in text
    assert ShardSet.open(out).vocab_size == 290
    assert main(["data", "inspect", str(out)]) == 0
    assert "all shards verified" in capsys.readouterr().out
    (out / "val-00000.bin").write_bytes(b"\x00\x01")
    assert main(["data", "inspect", str(out)]) == 1
    assert "val-00000.bin" in capsys.readouterr().err


def test_train_runs_and_resumes(prepared: Path, tmp_path: Path, tiny_config, capsys: pytest.CaptureFixture[str]) -> None:
    cfg_file = tmp_path / "train.json"
    dump_config(tiny_config(prepared, tmp_path / "run", steps=4, eval_every=4, checkpoint_every=0), cfg_file)
    argv = [str(cfg_file), "--no-progress", "--no-tensorboard"]
    assert main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "step 4: loss" in out and "val_loss" in out and "checkpoint:" in out and "sample:" in out
    assert (tmp_path / "run" / "checkpoints" / "step-000004").is_dir()
    # a second run into the same directory must say how to continue rather than overwrite
    assert main(["train", *argv]) == 2
    assert "--resume" in capsys.readouterr().err
    assert main(["train", *argv, "--resume", "--steps", "6"]) == 0
    assert "resuming at step 4" in capsys.readouterr().out
    assert (tmp_path / "run" / "checkpoints" / "step-000006").is_dir()


def test_bad_config_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--set", "model.n_heads=7", "--print-config"]) == 2
    assert "n_heads" in capsys.readouterr().err
    assert main(["train", "--set", "modle.d_model=3"]) == 2
    assert "did you mean `model`" in capsys.readouterr().err
    # an explicit out_dir: the default (runs/shakespeare under the cwd) may hold README command 1's run
    assert main(["train", "--set", "data.path=" + str(tmp_path / "nowhere"), "--out-dir", str(tmp_path / "run"),
                 "--no-progress"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_embedded_defaults_and_overrides(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--print-config", "--steps", "123", "--set", "model.n_layers=2"]) == 0
    printed = TrainConfig.from_dict(json.loads(capsys.readouterr().out))
    assert printed.steps == 123 and printed.model.n_layers == 2
    assert printed.model.d_model == default_config().model.d_model
    assert printed.data.vocab_size <= printed.model.vocab_size  # the defaults are consistent
    cfg = apply_overrides(default_config(), ["optimizer.betas=[0.8, 0.9]", "out_dir=x"])
    assert cfg.optimizer.betas == (0.8, 0.9) and cfg.out_dir == "x"
