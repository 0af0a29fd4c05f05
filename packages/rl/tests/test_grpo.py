"""The GRPO loop on a tiny model: metrics, the three loss variants, faults (a raising reward, all-equal groups,
non-finite losses), bad input, and the reward plugins' lookup."""

from __future__ import annotations

import json

import pytest
import torch
from plyx.rl import DataError, GRPOConfig, RewardError, RewardSpec, grpo
from plyx.specs import Component, hookimpl, plugins

from ._grpo_fixtures import setup_run, tiny_model


class _TestRewards:
    """In-process reward plugin: `parity` (varied: first token id's parity), `flaky` (raises on some samples)."""

    @staticmethod
    def _parity(**_):
        return lambda prompts, completions, completion_ids, **c: [float(ids[0] % 2) if ids else None
                                                                   for ids in completion_ids]

    @staticmethod
    def _flaky(**_):
        def fn(prompts, completions, completion_ids, **c):
            if any(ids and ids[0] % 3 == 0 for ids in completion_ids):
                raise ZeroDivisionError("flaky reward")
            return [1.0] * len(completions)
        return fn

    @hookimpl
    def plyx_reward_functions(self):
        return [Component("parity", self._parity, "test"), Component("flaky", self._flaky, "test")]


@pytest.fixture
def test_rewards():
    plugins.register_plugin(_TestRewards(), "grpo-test-rewards")
    yield
    plugins.unregister_plugin("grpo-test-rewards")


def _config(tmp_path, data, **kw):
    base = dict(data=str(data), out_dir=str(tmp_path / "out"), steps=3, batch_size=2, num_generations=4,
                max_new_tokens=6, max_length=64, log_every=1, device="cpu", optimizer={"lr": 1e-3},
                rewards=(RewardSpec(name="parity"), RewardSpec(name="exact_match", weight=0.5)),
                accuracy_reward="exact_match")
    base.update(kw)
    return GRPOConfig.from_dict(base) if isinstance(base["optimizer"], dict) else GRPOConfig(**base)


@pytest.mark.parametrize("loss_type,extra", [("grpo", {"beta": 0.04}), ("dr_grpo", {"share_prompt": False}),
                                             ("dapo", {"num_iterations": 2})])
def test_runs_each_variant_and_logs_the_metrics(tmp_path, test_rewards, loss_type, extra):
    tok, template, data = setup_run(tmp_path)
    model = tiny_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lines: list[str] = []
    cfg = _config(tmp_path, data, loss_type=loss_type, rewards=[{"name": "parity"}, {"name": "exact_match",
                                                                                  "weight": 0.5}], **extra)
    result = grpo(cfg, model=model, tokenizer=tok, template=template, print_fn=lines.append)
    assert result.step == 3 and len(result.history) == 3
    row = result.history[0]
    for key in ("reward", "reward_std", "rewards/parity/mean", "rewards/parity/std", "rewards/exact_match/mean",
                "accuracy", "kl", "clip_fraction", "completion_length", "gen_share", "train_share", "sync_s",
                "all_equal_groups", "dropped_groups", "samples_per_s", "tokens_per_s"):
        assert key in row, key
    assert 0 < row["gen_share"] < 1 and abs(row["gen_share"] + row["train_share"] - 1) < 0.05
    assert 1 <= row["completion_length"] <= 6
    trained = [r for r in result.history if r["groups_trained"] > 0]
    assert trained, "no step had a group with reward variance"
    assert all(r["sync_s"] > 0 for r in trained)  # weights went into the engine after each update
    assert any(not torch.equal(before[k], v) for k, v in result.model.state_dict().items())
    if loss_type == "dapo":
        assert any(r["clip_fraction"] >= 0 for r in trained) and cfg.num_iterations == 2
    if loss_type == "grpo":
        assert all(r["kl"] >= 0 for r in trained)
    rows = [json.loads(x) for x in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert (result.model_dir / "model.safetensors").exists() or any(result.model_dir.glob("*.safetensors"))


def test_engine_samples_the_updated_policy(tmp_path, test_rewards, monkeypatch):
    """After the run the engine's weights are the policy's (synced in place, no reload)."""
    import copy

    from plyx.rl import _grpo

    tok, template, data = setup_run(tmp_path)
    seen = {}
    real = copy.deepcopy

    def spy(obj, *a):
        out = real(obj, *a)
        seen.setdefault("engine_model", out)  # the run's first deep copy is the engine's model
        return out

    monkeypatch.setattr(_grpo.copy, "deepcopy", spy)
    result = grpo(_config(tmp_path, data), model=tiny_model(), tokenizer=tok, template=template,
                  print_fn=lambda s: None)
    monkeypatch.undo()
    assert result.history[-1]["groups_trained"] > 0 or any(r["groups_trained"] for r in result.history)
    for (name, p), q in zip(seen["engine_model"].named_parameters(), result.model.parameters()):
        assert torch.equal(p, q), name


def test_dapo_dynamic_sampling_drops_and_counts_all_equal_groups(tmp_path):
    tok, template, data = setup_run(tmp_path)
    # exact_match on an untrained model: every group all 0 -> every group dropped, steps skipped, counted
    cfg = _config(tmp_path, data, loss_type="dapo", rewards=(RewardSpec(name="exact_match"),), max_sampling_rounds=2)
    lines: list[str] = []
    result = grpo(cfg, model=tiny_model(), tokenizer=tok, template=template, print_fn=lines.append)
    last = result.history[-1]
    assert last["all_equal_groups"] == last["dropped_groups"] == 3 * 2 * 2  # steps x rounds x prompts
    assert last["skipped_steps"] == 3 and last["groups_trained"] == 0
    assert any("no update" in s for s in lines)


def test_a_raising_reward_scores_none_and_the_run_continues(tmp_path, test_rewards):
    tok, template, data = setup_run(tmp_path)
    cfg = _config(tmp_path, data, rewards=(RewardSpec(name="parity"), RewardSpec(name="flaky")), accuracy_reward="")
    lines: list[str] = []
    result = grpo(cfg, model=tiny_model(), tokenizer=tok, template=template, print_fn=lines.append)
    assert result.step == 3
    errors = result.history[-1]["reward_errors"]
    assert errors > 0 and any("ZeroDivisionError: flaky reward" in s for s in lines)
    # only the failing samples were dropped: the others kept their 1.0
    assert result.history[-1]["rewards/flaky/mean"] == 1.0
    strict = _config(tmp_path, data, rewards=(RewardSpec(name="flaky"),), accuracy_reward="", strict=True,
                     out_dir=str(tmp_path / "strict"))
    with pytest.raises(RewardError, match="flaky.*strict"):
        grpo(strict, model=tiny_model(), tokenizer=tok, template=template, print_fn=lambda s: None)


def test_non_finite_losses_are_skipped_named_and_stop_the_run(tmp_path, test_rewards, monkeypatch):
    from plyx.rl import _grpo

    tok, template, data = setup_run(tmp_path)
    real = _grpo.grpo_loss
    calls = {"n": 0}
    bad_updates: set[int] = {1}

    def faulty(*a, **k):
        out = real(*a, **k)
        calls["n"] += 1
        if calls["n"] in bad_updates:
            return type(out)(out.loss * float("nan"), out.kl, out.clip_low, out.clip_high, out.clip_fraction, out.tokens)
        return out

    monkeypatch.setattr(_grpo, "grpo_loss", faulty)
    lines: list[str] = []
    cfg = _config(tmp_path, data, micro_batch_groups=8)
    result = grpo(cfg, model=tiny_model(), tokenizer=tok, template=template, print_fn=lines.append)
    assert result.history[-1]["nan_updates"] == 1 and result.step == 3
    assert any("update 1: the loss is not finite" in s and "skipped" in s for s in lines)
    bad_updates.update(range(1, 100))  # every update: K in a row stop the run with the steps named
    calls["n"] = 0
    with pytest.raises(FloatingPointError, match="2 consecutive updates.*step 2"):
        grpo(_config(tmp_path, data, max_nan_steps=2, out_dir=str(tmp_path / "nan")), model=tiny_model(),
             tokenizer=tok, template=template, print_fn=lambda s: None)


def test_bad_input_is_refused_before_anything_is_written(tmp_path, test_rewards):
    tok, template, data = setup_run(tmp_path)
    out = tmp_path / "out"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "add 1 2", "answer": "3"}\n{"answer": "4"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: missing field 'prompt'"):
        grpo(_config(tmp_path, bad), model=tiny_model(), tokenizer=tok, template=template, print_fn=lambda s: None)
    with pytest.raises(LookupError, match="reward 'exact_mtch'.*misspelled or not installed.*exact_match"):
        grpo(_config(tmp_path, data, rewards=(RewardSpec(name="exact_mtch"),)), model=tiny_model(), tokenizer=tok,
             template=template, print_fn=lambda s: None)
    with pytest.raises(DataError, match="accuracy_reward 'nope'"):
        grpo(_config(tmp_path, data, accuracy_reward="nope"), model=tiny_model(), tokenizer=tok, template=template,
             print_fn=lambda s: None)
    with pytest.raises(ValueError, match="regex_format pattern.*does not compile"):
        grpo(_config(tmp_path, data, rewards=(RewardSpec(name="regex_format", args={"pattern": "(["}),),
                     accuracy_reward=""), model=tiny_model(), tokenizer=tok, template=template, print_fn=lambda s: None)
    assert not out.exists()
    with pytest.raises(FileNotFoundError, match="--resume: no checkpoint"):
        grpo(_config(tmp_path, data), model=tiny_model(), tokenizer=tok, template=template, resume=True,
             print_fn=lambda s: None)
