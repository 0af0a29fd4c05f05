"""The demonstration pipeline (pretrain -> SFT -> DPO -> held-out accuracy) at a size that runs in seconds."""

from __future__ import annotations

import json

import torch
from plyx.rl._demo import DemoSizes, run_demo


def test_demo_pipeline_runs_every_stage_and_records_results(tmp_path):
    sizes = DemoSizes(d_model=32, n_layers=1, n_heads=2, train_tasks=120, test_tasks=16, dpo_pairs=40,
                      pretrain_steps=4, sft_steps=4, dpo_steps=2, batch_size=8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_demo(tmp_path, sizes, print_fn=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    acc = result["accuracy"]
    assert set(acc) == {"before_sft", "after_sft", "after_dpo", "control_sft_on_chosen"}
    for stage in acc.values():
        assert 0.0 <= stage["accuracy"] <= 1.0
        assert {"accuracy/add", "accuracy/reverse", "accuracy/sort", "accuracy/date"} <= set(stage)
    assert result["dpo"]["pairs"] == 40 and 0 <= result["dpo"]["on_policy_rejected"] <= 40
    assert "rewards/margins" in result["dpo"]["final"] and "nll_loss" in result["dpo"]["final"]
    assert json.loads((tmp_path / "results.json").read_text())["accuracy"] == acc
    pairs = [json.loads(line) for line in (tmp_path / "dpo.jsonl").read_text().splitlines()]
    assert all(p["chosen"] != p["rejected"] for p in pairs)
    for stage in ("pretrain", "sft", "dpo", "control"):
        assert (tmp_path / stage / "model" / "model_card.json").is_file()


def test_grpo_demo_pipeline_runs_every_stage(tmp_path):
    from plyx.rl._grpo_demo import GRPODemoSizes, run_grpo_demo

    sizes = GRPODemoSizes(base=DemoSizes(d_model=32, n_layers=1, n_heads=2, train_tasks=120, test_tasks=16,
                                         dpo_pairs=40, pretrain_steps=4, sft_steps=4, batch_size=8, control=False),
                          grpo_prompts=40, task_tests=8, grpo_steps=2, prompts_per_step=2, num_generations=2,
                          max_new_tokens=6)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        result = run_grpo_demo(tmp_path, sizes, print_fn=lambda *_: None)
    finally:
        torch.set_num_threads(threads)
    assert set(result["accuracy"]) == {"after_sft", "after_grpo", "control_sft_on_answers"}
    assert result["grpo_prompts"] == 40 and result["grpo"]["final"]["step"] == 2
    assert all(0 <= a["task"] <= 1 for a in result["accuracy"].values())
    prompts = [json.loads(line)["prompt"][0]["content"] for line in (tmp_path / "grpo.jsonl").read_text().splitlines()]
    sft_prompts = {json.loads(line)["messages"][0]["content"] for line in (tmp_path / "sft.jsonl").read_text().splitlines()}
    assert all(p.startswith("sort ") for p in prompts) and not set(prompts) & sft_prompts
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and "accuracy" in rows[0]
    for stage in ("sft", "grpo", "control"):
        assert (tmp_path / stage / "model" / "model_card.json").is_file()
