"""``distill`` / ``plyx rl distill`` end to end on tiny models: the student moves towards the teacher on held-out
data (off-policy and on-policy), an HF-format teacher directory loads, and bad input is named before anything is
written."""

from __future__ import annotations

import json

import pytest
import torch
from plyx.rl import make_tasks
from plyx.rl._demo import build_tokenizer, write_jsonl
from plyx.rl._distill_run import DistillConfig, distill
from plyx.specs import ConfigError, ModelConfig, OptimizerConfig, ScheduleConfig

COMMON = {"device": "cpu", "max_length": 48, "batch_size": 8, "log_every": 1,
          "schedule": ScheduleConfig(kind="constant", warmup_steps=0),
          "optimizer": OptimizerConfig(lr=5e-3, weight_decay=0.0)}


def _model(d_model: int, layers: int, seed: int, vocab: int = 320):
    from plyx.model import TransformerLM

    torch.manual_seed(seed)
    return TransformerLM(ModelConfig(arch="llama", vocab_size=vocab, d_model=d_model, n_layers=layers,
                                     n_heads=2, d_ff=2 * d_model, max_seq_len=96))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A 32-wide student checkpoint with the ChatML tokenizer, a 64-wide teacher (HF format), train/held-out data."""
    from plyx.model import save_checkpoint, save_hf

    root = tmp_path_factory.mktemp("distill")
    save_checkpoint(_model(32, 1, 0), root / "student")
    tok = build_tokenizer(root / "student")
    teacher = _model(64, 2, 1)
    with torch.no_grad():  # a sharper teacher: a distribution with a shape worth copying
        teacher.lm_head_weight.mul_(4.0)
    save_hf(teacher, root / "teacher_hf")
    save_checkpoint(teacher, root / "teacher_plyx")
    write_jsonl(root / "train.jsonl", [{"messages": t.messages()} for t in make_tasks(32, split="train", seed=1)])
    write_jsonl(root / "test.jsonl", [{"messages": t.messages()} for t in make_tasks(16, split="test", seed=2)])
    return root, tok


def _config(root, tmp_path, **fields):
    base = dict(model=str(root / "student"), teacher=str(root / "teacher_hf"), data=str(root / "train.jsonl"),
                eval_data=str(root / "test.jsonl"), out_dir=str(tmp_path / "run"), steps=12, **COMMON)
    base.update(fields)
    return DistillConfig(**base)


@pytest.mark.parametrize("loss,options", [("forward_kl", {}), ("jsd", {"beta": 0.5}), ("topk", {"top_k": 16})])
def test_off_policy_distillation_lowers_held_out_divergence(setup, tmp_path, loss, options):
    root, _ = setup
    result = distill(_config(root, tmp_path, loss=loss, **options), print_fn=lambda *_: None)
    before, after = result.metrics["eval/divergence_before"], result.metrics["eval/divergence_after"]
    assert after < 0.8 * before, (before, after)
    report = json.loads((tmp_path / "run" / "eval.json").read_text())
    assert report["divergence_after"] == after and report["examples"] == 16
    assert (result.model_dir / "model_card.json").is_file() and (result.model_dir / "tokenizer.json").is_file()
    assert all(row["on_policy"] == 0.0 for row in result.history)


def test_on_policy_distillation_samples_with_the_engine_and_learns(setup, tmp_path):
    from plyx.model import load_checkpoint

    root, _ = setup
    teacher = load_checkpoint(root / "teacher_hf")  # the in-memory path (the same HF directory)
    result = distill(_config(root, tmp_path, loss="reverse_kl", on_policy_fraction=1.0, max_new_tokens=8, steps=8),
                     teacher=teacher, print_fn=lambda *_: None)
    assert all(row["on_policy"] == 1.0 for row in result.history)
    assert all(row["generate_s"] > 0 for row in result.history)
    # completions are the student's samples: at most max_new_tokens long (the dataset's answers are longer
    # once the end-of-turn and newline are counted, so a larger count would mean dataset completions)
    assert all(0 < row["completion_tokens"] <= 8 for row in result.history)
    assert result.metrics["eval/divergence_after"] < result.metrics["eval/divergence_before"]


def test_bad_input_is_named_before_anything_is_written(setup, tmp_path):
    from plyx.rl import DataError

    root, _ = setup
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match=r"unknown distillation loss - at `\$.loss` \(got 'fwd_kl'\).*forward_kl"):
        _config(root, tmp_path, loss="fwd_kl")
    with pytest.raises(ConfigError, match="did you mean 'reverse_kl'"):
        _config(root, tmp_path, loss="reverse-kl")
    with pytest.raises(ConfigError, match="needs top_k >= 1"):
        _config(root, tmp_path, loss="topk")
    with pytest.raises(DataError, match="top_k 400 exceeds the vocabulary size 320"):
        distill(_config(root, tmp_path, loss="topk", top_k=400), print_fn=lambda *_: None)
    other = _model(64, 1, 2, vocab=384)
    with pytest.raises(DataError, match="vocabulary mismatch: the student has 320 tokens and the teacher 384.*"
                                        "one tokenizer.*vocab_size = 384"):
        distill(_config(root, tmp_path), teacher=other, print_fn=lambda *_: None)
    with pytest.raises(FileNotFoundError, match="teacher checkpoint"):
        distill(_config(root, tmp_path, teacher=str(tmp_path / "nope")), print_fn=lambda *_: None)
    assert not out.exists() or not any(out.iterdir())


def test_cli_distill(setup, tmp_path, capsys):
    from plyx.specs.cli import main

    root, _ = setup
    cfg = tmp_path / "distill.toml"
    cfg.write_text(f'model = "{root / "student"}"\nteacher = "{root / "teacher_plyx"}"\ndata = "{root / "train.jsonl"}"\n'
                   f'eval_data = "{root / "test.jsonl"}"\nsteps = 2\nbatch_size = 4\ndevice = "cpu"\nmax_length = 48\n'
                   'loss = "jsd"\nbeta = 0.3\nteacher_dtype = "bfloat16"\n')
    assert main(["rl", "distill", str(cfg), "--out-dir", str(tmp_path / "d"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "eval/divergence_after" in out and "model: " in out
    assert json.loads((tmp_path / "d" / "config.json").read_text())["beta"] == 0.3
    assert main(["rl", "distill", str(cfg), "--print-config", "--set", 'loss="kl"']) == 2
    assert "unknown distillation loss" in capsys.readouterr().err
