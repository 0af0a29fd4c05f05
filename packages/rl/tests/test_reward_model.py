"""Reward models: the Bradley-Terry loss against its formula, a tiny reward model learning a synthetic preference
(held-out pair accuracy well above chance), the saved directory round trip and the GRPO reward factory."""

from __future__ import annotations

import json
import math
import random

import pytest
import torch
from plyx.rl._demo import build_tokenizer, write_jsonl
from plyx.rl._reward_model import (
    RewardModelConfig,
    bradley_terry_loss,
    load_reward_model,
    reward_model_reward,
    train_reward_model,
)
from plyx.specs import ModelConfig, OptimizerConfig, ScheduleConfig

GOOD = ("great", "fine", "nice", "good")
BAD = ("awful", "poor", "bad", "sad")


def _completion(rng: random.Random, words: tuple[str, ...]) -> str:
    """A few random filler words with one word of ``words`` at a random place."""
    filler = ["".join(rng.choice("klmnqrstvwxz") for _ in range(rng.randint(2, 4))) for _ in range(rng.randint(1, 3))]
    filler.insert(rng.randint(0, len(filler)), rng.choice(words))
    return " ".join(filler)


def _pairs(n: int, seed: int, margin: bool = False) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rec = {"prompt": f"review {rng.randint(0, 99)}:", "chosen": " " + _completion(rng, GOOD),
               "rejected": " " + _completion(rng, BAD)}
        if margin:
            rec["margin"] = rng.choice([0.0, 1.0])
        out.append(rec)
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from plyx.model import TransformerLM, save_checkpoint

    root = tmp_path_factory.mktemp("rm")
    torch.manual_seed(0)
    save_checkpoint(TransformerLM(ModelConfig(arch="llama", vocab_size=320, d_model=32, n_layers=2, n_heads=2,
                                              d_ff=64, max_seq_len=64)), root / "base")
    build_tokenizer(root / "base")
    write_jsonl(root / "train.jsonl", _pairs(128, seed=1, margin=True))
    write_jsonl(root / "test.jsonl", _pairs(64, seed=2))
    return root


def test_bradley_terry_loss_is_the_published_formula():
    rc = torch.tensor([1.0, -0.5, 2.0, 0.0], dtype=torch.float64)
    rr = torch.tensor([0.0, 0.5, -1.0, 0.0], dtype=torch.float64)
    m = torch.tensor([0.0, 1.0, 0.5, 2.0], dtype=torch.float64)
    want = sum(-math.log(1 / (1 + math.exp(-(a - b - c)))) for a, b, c in zip(rc.tolist(), rr.tolist(), m.tolist()))
    assert float(bradley_terry_loss(rc, rr, m)) == pytest.approx(want / 4, rel=1e-12)
    assert float(bradley_terry_loss(rc, rr)) == pytest.approx(
        sum(math.log1p(math.exp(-(a - b))) for a, b in zip(rc.tolist(), rr.tolist())) / 4, rel=1e-12)
    centred = bradley_terry_loss(rc, rr, m, center_rewards_coefficient=0.1)
    assert float(centred) == pytest.approx(want / 4 + 0.1 * float(((rc + rr) ** 2).mean()), rel=1e-12)
    # the margin asks for a larger gap: the same rewards cost more with it
    assert float(bradley_terry_loss(rc, rr, 1.0)) > float(bradley_terry_loss(rc, rr))


@pytest.mark.parametrize("center", [None, 0.01])
@pytest.mark.parametrize("with_margin", [False, True])
def test_bradley_terry_loss_matches_trl_reward_trainer(center, with_margin):
    """TRL's ``RewardTrainer.compute_loss`` (the oracle) on the same rewards: values and gradients."""
    pytest.importorskip("trl")
    from collections import defaultdict
    from types import SimpleNamespace

    from trl import RewardTrainer

    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(12, generator=g, dtype=torch.float64).requires_grad_()  # chosen 6, then rejected 6
    margin = torch.rand(6, generator=g, dtype=torch.float64)
    trainer = object.__new__(RewardTrainer)
    trainer.model = SimpleNamespace(training=False)
    trainer.args = SimpleNamespace(center_rewards_coefficient=center)
    trainer.accelerator = SimpleNamespace(gather=lambda x: x, gather_for_metrics=lambda x: x)
    trainer._metrics = {"eval": defaultdict(list)}
    trainer._total_train_tokens = 0
    inputs = {"input_ids": torch.zeros(12, 3, dtype=torch.long), "attention_mask": torch.ones(12, 3)}
    if with_margin:
        inputs["margin"] = margin
    expected = trainer.compute_loss(lambda **_: SimpleNamespace(logits=rewards[:, None]), inputs)
    (g_expected,) = torch.autograd.grad(expected, rewards)
    ours = bradley_terry_loss(rewards[:6], rewards[6:], margin if with_margin else None,
                              center_rewards_coefficient=center or 0.0)
    (g_ours,) = torch.autograd.grad(ours, rewards)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(g_ours, g_expected, rtol=1e-12, atol=1e-14)


def test_reward_model_learns_a_preference_and_scores_as_a_reward_function(setup, tmp_path):
    root = setup
    cfg = RewardModelConfig(model=str(root / "base"), data=str(root / "train.jsonl"),
                            eval_data=str(root / "test.jsonl"), out_dir=str(tmp_path / "rm"), steps=60,
                            batch_size=16, max_length=48, device="cpu", log_every=10, margin=0.5,
                            optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0),
                            schedule=ScheduleConfig(kind="constant", warmup_steps=0))
    result = train_reward_model(cfg, print_fn=lambda *_: None)
    m = result.metrics
    assert m["eval/accuracy"] >= 0.85 and m["eval/accuracy"] > m["eval/accuracy_before"] + 0.2, m
    assert json.loads((tmp_path / "rm" / "eval.json").read_text())["accuracy"] == m["eval/accuracy"]
    assert result.history[-1]["loss"] < result.history[0]["loss"]

    # the saved directory scores exactly what the trained model in memory scores
    loaded, tokenizer, _ = load_reward_model(result.model_dir)
    ids = torch.tensor([tokenizer.encode("review 3: nice kk")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, torch.tensor([ids.shape[1]])),
                                   result.model(ids, torch.tensor([ids.shape[1]])))

    fn = reward_model_reward(str(result.model_dir), device="cpu", batch_size=3, unused_option=1)
    rng = random.Random(5)
    prompts = [f"review {i}:" for i in range(8)]
    good = [" " + _completion(rng, GOOD) for _ in prompts]
    bad = [" " + _completion(rng, BAD) for _ in prompts]
    scores = fn(prompts * 2, good + bad, answer=["x"] * 16)
    assert len(scores) == 16 and all(isinstance(s, float) for s in scores)
    assert sum(g > b for g, b in zip(scores[:8], scores[8:])) >= 6
    # a batch of one gives the same scores as a batch of several (padding does not leak into the last token)
    assert fn(prompts[:1], good[:1])[0] == pytest.approx(scores[0], abs=1e-5)
    with pytest.raises(ValueError, match="2 prompts but 1 completions"):
        fn(prompts[:2], good[:1])


def test_bad_margin_and_missing_directory_are_named(setup, tmp_path):
    from plyx.rl import DataError

    root = setup
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "chosen": " a", "rejected": " b", "margin": "big"}])
    cfg = RewardModelConfig(model=str(root / "base"), data=str(bad), out_dir=str(tmp_path / "o"), device="cpu")
    with pytest.raises(DataError, match=r"bad.jsonl:1: 'margin' must be a number \(got 'big'\)"):
        train_reward_model(cfg, print_fn=lambda *_: None)
    assert not (tmp_path / "o").exists()
    with pytest.raises(FileNotFoundError, match="is not a reward model"):
        reward_model_reward(str(root / "base"))


def test_cli_rm(setup, tmp_path, capsys):
    from plyx.specs.cli import main

    root = setup
    cfg = tmp_path / "rm.toml"
    cfg.write_text(f'model = "{root / "base"}"\ndata = "{root / "train.jsonl"}"\neval_data = "{root / "test.jsonl"}"\n'
                   'steps = 2\nbatch_size = 4\ndevice = "cpu"\nmax_length = 48\n')
    assert main(["rl", "rm", str(cfg), "--out-dir", str(tmp_path / "r"), "--no-progress", "--set", "margin=1.0"]) == 0
    out = capsys.readouterr().out
    assert "eval/accuracy" in out and "reward_model" in out
    assert (tmp_path / "r" / "reward_model" / "score.safetensors").is_file()
    assert json.loads((tmp_path / "r" / "config.json").read_text())["margin"] == 1.0
