"""``plyx train`` tells a new user what happened and what to do next: log lines, next commands, clear refusals."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from plyx.specs import TrainConfig, dump_config
from plyx.specs.cli import main
from plyx.train._cli import shipped_configs
from plyx.train._prepare import cache_dir, default_data_dir


def _config_file(tiny_config, prepared: Path, tmp_path: Path, **overrides) -> Path:
    cfg = tmp_path / "train.json"
    dump_config(tiny_config(prepared, tmp_path / "my-run", **overrides), cfg)
    return cfg


def test_cache_location_follows_plyx_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLYX_CACHE_DIR", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    assert default_data_dir(1024) == tmp_path / "c" / "data" / "tinyshakespeare-bpe1024"
    assert default_data_dir(1024, "char") == tmp_path / "c" / "data" / "tinyshakespeare-char"
    monkeypatch.setenv("PLYX_DATA_DIR", str(tmp_path / "d"))  # the older, narrower override still wins
    assert default_data_dir(300) == tmp_path / "d" / "tinyshakespeare-bpe300"


def test_no_progress_prints_log_lines_and_the_next_commands(
    prepared: Path, tmp_path: Path, tiny_config, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _config_file(tiny_config, prepared, tmp_path, steps=6, log_every=2, eval_every=0, checkpoint_every=0)
    assert main(["train", str(cfg), "--no-progress", "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("step ") and " | " in line]
    assert [int(line.split()[1]) for line in lines] == [2, 4, 6]  # every log_every steps
    assert re.fullmatch(r"step 2 \| loss \d+\.\d{4} \| lr \S+ \| \d+ ms \| [\d.]+k? tok/s \| eta \d+:\d\d:\d\d",
                        lines[0]), lines[0]
    ckpt = tmp_path / "my-run" / "checkpoints" / "step-000006"
    nxt = out.split("next:\n", 1)[1]
    assert f"plyx model inspect {ckpt}" in nxt
    assert f"plyx serve {ckpt.parent / 'latest'} --port 8000" in nxt and "model id my-run" in nxt
    assert f"plyx export {ckpt.parent / 'latest'} --format onnx --out exports/my-run" in nxt
    assert "plyx governance verify exports/my-run" in nxt


def test_progress_on_a_pipe_gets_log_lines(prepared: Path, tmp_path: Path, tiny_config,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Without --no-progress but not on a terminal (capsys is not a tty): lines, not a bar drawn at the end."""
    cfg = _config_file(tiny_config, prepared, tmp_path, steps=4, log_every=2, eval_every=0, checkpoint_every=0)
    assert main(["train", str(cfg), "--no-tensorboard"]) == 0
    out = capsys.readouterr().out
    assert "step 2 | loss" in out and "step 4 | loss" in out


def test_resume_with_nothing_to_resume_is_refused(prepared: Path, tmp_path: Path, tiny_config,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config_file(tiny_config, prepared, tmp_path, steps=2)
    assert main(["train", str(cfg), "--resume", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "holds no checkpoint to resume" in err and "drop --resume" in err
    assert not (tmp_path / "my-run" / "checkpoints").exists()  # nothing was started


def test_model_card_is_filled_and_settable(prepared: Path, tmp_path: Path, tiny_config,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config_file(tiny_config, prepared, tmp_path, steps=4, eval_every=4, checkpoint_every=0)
    assert main(["train", str(cfg), "--no-progress", "--no-tensorboard"]) == 0
    ckpt = tmp_path / "my-run" / "checkpoints" / "step-000004"
    card = json.loads((ckpt / "model_card.json").read_text())
    val = card["training"]["val_loss"]
    assert card["name"] == "my-run" and card["license"] == "NOASSERTION"
    assert "4 of 4 steps" in card["description"] and f"validation loss {val:.4f}" in card["description"]
    assert str(prepared) in card["description"] or "corpus" in card["description"]
    # the default chat template is recorded with the tokenizer, beside tokenizer.json
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    assert tok_cfg["eos_token"] == "<|endoftext|>" and "add_generation_prompt" in tok_cfg["chat_template"]
    capsys.readouterr()
    assert main(["train", str(cfg), "--no-progress", "--no-tensorboard", "--overwrite", "--name", "bard",
                 "--license", "MIT", "--description", "a test model"]) == 0
    card = json.loads((ckpt / "model_card.json").read_text())
    assert (card["name"], card["license"], card["description"]) == ("bard", "MIT", "a test model")



def test_the_config_card_table_sets_the_model_card(prepared: Path, tmp_path: Path, tiny_config,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A TOML ``[card]`` table names, licenses and describes the model; an empty field stays derived, and the
    command line's ``--name`` still wins over the table."""
    cfg = tmp_path / "train.toml"
    dump_config(tiny_config(prepared, tmp_path / "my-run", steps=2, eval_every=0, checkpoint_every=0,
                            card={"name": "bard-small", "license": "Apache-2.0"}), cfg)
    assert "[card]" in cfg.read_text()  # the table a user writes
    assert main(["train", str(cfg), "--no-progress", "--no-tensorboard"]) == 0
    assert "model id bard-small" in capsys.readouterr().out  # the next commands name the served model
    ckpt = tmp_path / "my-run" / "checkpoints" / "step-000002"
    card = json.loads((ckpt / "model_card.json").read_text())
    assert (card["name"], card["license"]) == ("bard-small", "Apache-2.0")
    assert "2 of 2 steps" in card["description"]  # not set: derived from the run
    assert main(["train", str(cfg), "--no-progress", "--no-tensorboard", "--overwrite", "--name", "bard",
                 "--description", "set here"]) == 0
    card = json.loads((ckpt / "model_card.json").read_text())
    assert (card["name"], card["license"], card["description"]) == ("bard", "Apache-2.0", "set here")

def test_shipped_nanogpt_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    from plyx.model import TransformerLM

    assert "shakespeare-char" in shipped_configs()
    assert main(["train", "shakespeare-char", "--print-config"]) == 0
    cfg = TrainConfig.from_dict(json.loads(capsys.readouterr().out))
    assert cfg.data.tokenizer == "char" and cfg.data.seq_len == 64 and cfg.batch_size == 12 and cfg.steps == 2000
    params = TransformerLM(cfg.model).num_params()
    assert 0.79e6 < params < 0.81e6  # nanoGPT's baby GPT: 0.80M
