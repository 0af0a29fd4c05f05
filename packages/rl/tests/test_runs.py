"""Tiny end-to-end runs: SFT (full, packed, LoRA), every preference method, the CLI, and what lands in out_dir."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch
from plyx.rl import (
    AdapterSettings,
    ChatTemplate,
    DataError,
    PreferenceConfig,
    SFTConfig,
    corrupt,
    make_tasks,
    preference,
    sft,
    split_of,
    strip_generation_tags,
)
from plyx.rl._demo import CHATML, build_tokenizer, write_jsonl
from plyx.specs import OptimizerConfig, ScheduleConfig

COMMON = {"device": "cpu", "max_length": 48, "batch_size": 4, "log_every": 1,
          "schedule": ScheduleConfig(kind="constant", warmup_steps=0)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 2-layer, 32-wide checkpoint with the ChatML tokenizer and template beside its weights."""
    from plyx.model import TransformerLM, save_checkpoint
    from plyx.specs import ModelConfig

    root = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    model = TransformerLM(ModelConfig(arch="llama", vocab_size=320, d_model=32, n_layers=2, n_heads=2, d_ff=64,
                                      max_seq_len=64))
    save_checkpoint(model, root / "model")
    tok = build_tokenizer(root / "model")
    tasks = make_tasks(24, split="train", seed=1)
    rng = random.Random(0)
    write_jsonl(root / "sft.jsonl", [{"messages": t.messages()} for t in tasks])
    write_jsonl(root / "pairs.jsonl", [{"prompt": [{"role": "user", "content": t.prompt}], "chosen": t.answer,
                                        "rejected": corrupt(t, rng)} for t in tasks])
    write_jsonl(root / "kto.jsonl", [{"prompt": [{"role": "user", "content": t.prompt}],
                                      "completion": t.answer if i % 2 else corrupt(t, rng), "label": bool(i % 2)}
                                     for i, t in enumerate(tasks)])
    return root, tok


def test_task_split_is_fixed_by_prompt():
    test = make_tasks(40, split="test", seed=3)
    train = make_tasks(400, split="train", seed=4)
    assert all(split_of(t.prompt) == "test" for t in test)
    assert not {t.prompt for t in test} & {t.prompt for t in train}
    assert make_tasks(40, split="test", seed=3) == test  # deterministic
    rng = random.Random(0)
    assert all(corrupt(t, rng) != t.answer for t in train)


def test_sft_full_fine_tune_learns_and_writes_a_servable_checkpoint(base, tmp_path):
    from plyx.model import load_checkpoint

    root, tok = base
    cfg = SFTConfig(model=str(root / "model"), data=str(root / "sft.jsonl"), out_dir=str(tmp_path / "run"), steps=12,
                    optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0), **COMMON)
    result = sft(cfg, print_fn=lambda *_: None)
    losses = [row["loss"] for row in result.history]
    assert len(losses) == 12 and losses[-1] < losses[0]
    model = load_checkpoint(result.model_dir)
    for a, b in zip(model.state_dict().values(), result.model.state_dict().values()):
        torch.testing.assert_close(a, b)
    assert (result.model_dir / "tokenizer.json").is_file()
    saved = json.loads((result.model_dir / "tokenizer_config.json").read_text())["chat_template"]
    assert saved == strip_generation_tags(CHATML) and "{% generation %}" not in saved  # serve's Jinja lacks the tag
    stops = json.loads((result.model_dir / "generation_config.json").read_text())["eos_token_id"]
    assert sorted(stops) == sorted([tok.eos_id, tok.inner.token_to_id("<|im_end|>")])
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())
    assert report["kept"] == 24
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 12


def test_sft_packed_with_lora_trains_only_the_adapter(base, tmp_path):
    from plyx.model import load_checkpoint

    root, _ = base
    start = load_checkpoint(root / "model")
    cfg = SFTConfig(model=str(root / "model"), data=str(root / "sft.jsonl"), out_dir=str(tmp_path / "run"), steps=6,
                    packing=True, adapter=AdapterSettings(r=4, alpha=8), neftune_alpha=5.0,
                    optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0), **COMMON)
    result = sft(cfg, print_fn=lambda *_: None)
    assert (result.adapter_dir / "adapter_config.json").is_file()
    assert (result.adapter_dir / "adapter_model.safetensors").is_file()
    base_w = {k: v for k, v in result.model.state_dict().items() if "lora" not in k.lower() and "base" not in k}
    assert base_w  # the frozen base is unchanged; the merged checkpoint differs from it
    merged = load_checkpoint(result.model_dir)
    q = merged.state_dict()["layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(q, start.state_dict()["layers.0.self_attn.q_proj.weight"])
    torch.testing.assert_close(merged.state_dict()["layers.0.mlp.gate_proj.weight"],
                               start.state_dict()["layers.0.mlp.gate_proj.weight"])  # not a target: untouched


@pytest.mark.parametrize("method,extra", [
    ("dpo", {"loss_type": "sigmoid"}), ("dpo", {"loss_type": "ipo"}), ("dpo", {"loss_type": "hinge"}),
    ("dpo", {"loss_type": "robust", "label_smoothing": 0.1}), ("dpo", {"reference_free": True}),
    ("dpo", {"rpo_alpha": 1.0}),
    ("orpo", {}), ("simpo", {}), ("kto", {})])
def test_preference_methods_raise_the_reward_margin(base, tmp_path, method, extra):
    root, _ = base
    data = root / ("kto.jsonl" if method == "kto" else "pairs.jsonl")
    cfg = PreferenceConfig(model=str(root / "model"), data=str(data), out_dir=str(tmp_path / "run"), method=method,
                           steps=8, optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0), **extra, **COMMON)
    result = preference(cfg, print_fn=lambda *_: None)
    last = result.history[-1]
    assert all(k in last for k in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen",
                                   "logps/rejected"))
    if method != "kto":
        assert "rewards/accuracies" in last
    else:
        assert last["kl"] >= 0
    # over the whole data set: log p(chosen or desirable) - log p(rejected or undesirable) went up
    from plyx.model import load_checkpoint

    before = _margin(load_checkpoint(root / "model"), base, method)
    after = _margin(result.model, base, method)
    assert after > before + 0.05, (before, after)
    assert (result.model_dir / "model_card.json").is_file()


def _margin(model, base, method):
    """Mean log-prob of the preferred completions minus that of the others, over the whole training file."""
    from plyx.rl import completion_rows, sequence_logps, tokenize_kto, tokenize_pairs

    root, tok = base
    template = ChatTemplate(CHATML)
    with torch.no_grad():
        if method == "kto":
            ex = tokenize_kto(root / "kto.jsonl", tok, template, max_length=48).examples
            lp = sequence_logps(model, completion_rows([e.prompt for e in ex], [e.completion for e in ex], 0))[0]
            good = torch.tensor([e.desirable for e in ex])
            return float(lp[good].mean() - lp[~good].mean())
        ex = tokenize_pairs(root / "pairs.jsonl", tok, template, max_length=48).examples
        c = sequence_logps(model, completion_rows([e.prompt for e in ex], [e.chosen for e in ex], 0))[0]
        r = sequence_logps(model, completion_rows([e.prompt for e in ex], [e.rejected for e in ex], 0))[0]
        return float((c - r).mean())


def test_dpo_with_lora_uses_the_disabled_adapter_base_as_reference(base, tmp_path):
    """The first step's rewards are 0: policy = reference (adapter B is zero), reference = base with adapters off."""
    root, _ = base
    cfg = PreferenceConfig(model=str(root / "model"), data=str(root / "pairs.jsonl"), out_dir=str(tmp_path / "run"),
                           steps=4, adapter=AdapterSettings(r=4, alpha=8, merge=False),
                           optimizer=OptimizerConfig(lr=1e-2, weight_decay=0.0), **COMMON)
    result = preference(cfg, print_fn=lambda *_: None)
    assert result.history[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6)
    assert result.history[0]["loss"] == pytest.approx(0.6931471805599453, abs=1e-6)  # -log sigmoid(0)
    assert result.model_dir is None and (result.adapter_dir / "adapter_config.json").is_file()
    assert abs(result.history[-1]["rewards/margins"]) > 0


def test_nothing_is_written_for_bad_data_and_out_dir_is_protected(base, tmp_path):
    root, _ = base
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "chosen": "a", "rejected": "b"}) + "\n{oops\n")
    out = tmp_path / "run"
    cfg = PreferenceConfig(model=str(root / "model"), data=str(bad), out_dir=str(out), steps=2, **COMMON)
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        preference(cfg, print_fn=lambda *_: None)
    assert not out.exists()
    out.mkdir()
    (out / "keep.txt").write_text("x")
    cfg = cfg.replace(data=str(root / "pairs.jsonl"))
    with pytest.raises(FileExistsError, match="not empty.*--overwrite"):
        preference(cfg, print_fn=lambda *_: None)


def test_cli_runs_sft_and_dpo_and_reports_errors(base, tmp_path, capsys):
    from plyx.specs.cli import main

    root, _ = base
    cfg = tmp_path / "sft.toml"
    cfg.write_text(f'model = "{root / "model"}"\ndata = "{root / "sft.jsonl"}"\nsteps = 2\nbatch_size = 4\n'
                   f'device = "cpu"\nmax_length = 48\n')
    # the real command once, in a fresh process: the subcommand comes from the plugin's entry point
    proc = subprocess.run([sys.executable, "-m", "plyx.specs", "rl", "sft", str(cfg), "--out-dir", str(tmp_path / "s"),
                           "--no-progress"], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "model: " in proc.stdout and (tmp_path / "s" / "model" / "model_card.json").is_file()
    dpo = tmp_path / "dpo.toml"
    dpo.write_text(cfg.read_text().replace("sft.jsonl", "pairs.jsonl") + 'loss_type = "ipo"\n')
    assert main(["rl", "dpo", str(dpo), "--out-dir", str(tmp_path / "d"), "--no-progress", "--set", "beta=0.2"]) == 0
    assert "rewards/accuracies" in capsys.readouterr().out
    assert json.loads((tmp_path / "d" / "config.json").read_text())["beta"] == 0.2
    assert main(["rl", "orpo", str(dpo), "--print-config"]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "orpo"  # the command's method wins
    assert main(["rl", "dpo", str(dpo), "--print-config", "--set", "betta=1"]) == 2
    assert "betta" in capsys.readouterr().err
    strict = tmp_path / "strict.jsonl"
    strict.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    code = main(["rl", "sft", str(cfg), "--set", f"data={json.dumps(str(strict))}", "--strict", "--out-dir",
                 str(tmp_path / "x")])
    assert code == 2 and ":1: record skipped (no_assistant_turn)" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_reference_log_probs_are_computed_once(base, tmp_path):
    """24 pairs: the reference costs 2 x ceil(24 / 16) forwards before training, then one forward per step."""
    from plyx.model import load_checkpoint

    root, _ = base
    model = load_checkpoint(root / "model")
    calls = []
    model.register_forward_pre_hook(lambda module, args: calls.append(torch.is_grad_enabled()))
    cfg = PreferenceConfig(model=str(root / "model"), data=str(root / "pairs.jsonl"), out_dir=str(tmp_path / "run"),
                           steps=5, **COMMON)
    preference(cfg, model=model, print_fn=lambda *_: None)
    assert calls == [False] * 4 + [True] * 5


def test_ctrl_c_finishes_the_step_and_saves(base, tmp_path):
    import signal

    from plyx.model import load_checkpoint

    root, _ = base
    model = load_checkpoint(root / "model")
    seen = []

    def interrupt_on_third_step(module, args):
        if torch.is_grad_enabled():
            seen.append(1)
            if len(seen) == 3:
                os.kill(os.getpid(), signal.SIGINT)  # arrives mid-step; the step still completes

    model.register_forward_pre_hook(interrupt_on_third_step)
    cfg = SFTConfig(model=str(root / "model"), data=str(root / "sft.jsonl"), out_dir=str(tmp_path / "run"), steps=50,
                    **COMMON)
    result = sft(cfg, model=model, print_fn=lambda *_: None)
    assert result.stopped == "SIGINT" and result.step == 3
    assert (result.model_dir / "model_card.json").is_file()
    assert json.loads((result.model_dir / "model_card.json").read_text())["training"]["stopped"] == "SIGINT"
