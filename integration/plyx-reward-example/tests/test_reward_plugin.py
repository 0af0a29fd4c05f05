"""plyx-reward-example installed beside plyx-rl: discovered, listed, and used by a GRPO run by name only.

Run where this distribution is installed (the integration session):
``pip install ./packages/* ./integration/plyx-reward-example[test]``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PLYX = [sys.executable, "-m", "plyx.specs"]


def test_listed_by_plyx_plugins_with_its_distribution():
    out = subprocess.run([*PLYX, "plugins", "--json"], capture_output=True, text=True, check=True).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["reward-example"]["distribution"] == "plyx-reward-example"
    assert rows["reward-example"]["status"] == "loaded"


def test_a_grpo_run_uses_it_by_name(tmp_path):
    pytest.importorskip("plyx.rl")
    import torch
    from plyx.model import TransformerLM
    from plyx.rl import GRPOConfig, build_rewards, grpo, make_tasks, reward_components
    from plyx.rl._chat import ChatTemplate
    from plyx.rl._demo import CHATML, build_tokenizer
    from plyx.specs import ModelConfig

    found = reward_components()
    assert found["contains_answer"].source.startswith("plyx-reward-example")
    [(label, weight, fn)] = build_rewards(GRPOConfig.from_dict(
        {"rewards": [{"name": "digit_ratio", "weight": 0.5, "args": {"scale": 2.0}}]}).rewards)
    assert (label, weight) == ("digit_ratio", 0.5) and fn(["p"], ["a1b2"]) == [1.0]

    tok = build_tokenizer(tmp_path / "tok")
    template = ChatTemplate(CHATML, eos_token=tok.eos_token, name="chatml")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": t.prompt}], "answer": t.answer}) + "\n"
                            for t in make_tasks(8, split="train")), encoding="utf-8")
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(vocab_size=320, d_model=32, n_layers=1, n_heads=2, d_ff=64, max_seq_len=64))
    config = GRPOConfig.from_dict({
        "data": str(data), "out_dir": str(tmp_path / "out"), "steps": 2, "batch_size": 2, "num_generations": 2,
        "max_new_tokens": 4, "max_length": 48, "device": "cpu", "accuracy_reward": "",
        "rewards": [{"name": "contains_answer"}, {"name": "digit_ratio", "args": {"scale": 0.5}}]})
    result = grpo(config, model=model, tokenizer=tok, template=template, print_fn=lambda s: None)
    assert "rewards/contains_answer/mean" in result.metrics and "rewards/digit_ratio/mean" in result.metrics
