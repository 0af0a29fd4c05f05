"""plyx-rl: post-training for plyx models: SFT, preference optimisation (DPO family, ORPO, SimPO, KTO), GRPO,
distillation, reward models and pairwise-judge rankings.

Python API: ``sft(SFTConfig(...))``, ``preference(PreferenceConfig(method="dpo", ...))``; the losses
(``dpo_loss``, ``orpo_loss``, ``simpo_loss``, ``kto_loss``) work on any sequence log-probs; chat templates
(``ChatTemplate``, ``load_chat_template``) render with Hugging Face ``apply_chat_template`` semantics;
``make_tasks`` generates verifiable tasks with a fixed held-out split; ``grpo(GRPOConfig(...))`` runs online
GRPO / Dr. GRPO / DAPO with reward plugins, sampling with plyx-serve's engine; ``distill(DistillConfig(...))``
with the chunked ``distill_loss``; ``train_reward_model`` / ``reward_model_reward`` (a GRPO reward function);
``rank_models`` / ``position_bias`` over judge verdicts.
"""

from typing import Any

__all__ = [
    "DISTILL_LOSSES",
    "DPO_LOSS_TYPES",
    "GRPO_LOSS_TYPES",
    "TASK_KINDS",
    "AdapterSettings",
    "ChatTemplate",
    "ChatTemplateError",
    "DataError",
    "DataReport",
    "GradKVCache",
    "GRPOConfig",
    "GRPOLoss",
    "DistillConfig",
    "DistillLossError",
    "JudgeRanking",
    "KTOExample",
    "PairExample",
    "PreferenceConfig",
    "PreferenceLoss",
    "PromptRecord",
    "RenderedChat",
    "RewardError",
    "RewardScores",
    "RewardSpec",
    "RewardModel",
    "RewardModelConfig",
    "RunConfig",
    "RunResult",
    "SFTConfig",
    "SFTExample",
    "Task",
    "build_rewards",
    "Verdict",
    "bradley_terry_loss",
    "collate_sft",
    "collect_verdicts",
    "completion_rows",
    "corrupt",
    "default_beta",
    "distill",
    "distill_loss",
    "distill_loss_logits",
    "dpo_loss",
    "greedy_answers",
    "group_advantages",
    "group_token_logps",
    "groups_token_logps",
    "share_prompt_default",
    "grpo",
    "grpo_loss",
    "kto_loss",
    "load_chat_template",
    "load_reward_model",
    "load_tokenizer_and_template",
    "make_tasks",
    "orpo_loss",
    "pack_sft",
    "position_bias",
    "preference",
    "preference_metrics",
    "rank_models",
    "read_jsonl",
    "reward_components",
    "read_verdicts",
    "reward_model_reward",
    "score",
    "score_completions",
    "sequence_logps",
    "sft",
    "simpo_loss",
    "split_of",
    "strip_generation_tags",
    "token_divergence",
    "token_logps",
    "tokenize_kto",
    "tokenize_pairs",
    "tokenize_prompts",
    "tokenize_sft",
    "train_reward_model",
]


def __getattr__(name: str) -> Any:
    """Load the public names on first use (PEP 562).

    Importing ``plyx.rl`` (and so its plugin entry point, ``plyx.rl._plugin``)
    imports nothing heavy: ``plyx --help`` and ``plyx plugins`` never load torch.
    The names live in ``plyx.rl._exports``.
    """
    if name in __all__:
        from plyx.rl import _exports

        value = getattr(_exports, name)
        globals()[name] = value  # later lookups are plain attribute reads
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
