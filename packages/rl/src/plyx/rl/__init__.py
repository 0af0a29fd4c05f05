"""plyx-rl: post-training for plyx models: SFT, preference optimisation (DPO family, ORPO, SimPO, KTO) and GRPO.

Python API: ``sft(SFTConfig(...))``, ``preference(PreferenceConfig(method="dpo", ...))``; the losses
(``dpo_loss``, ``orpo_loss``, ``simpo_loss``, ``kto_loss``) work on any sequence log-probs; chat templates
(``ChatTemplate``, ``load_chat_template``) render with Hugging Face ``apply_chat_template`` semantics;
``make_tasks`` generates verifiable tasks with a fixed held-out split; ``grpo(GRPOConfig(...))`` runs online
GRPO / Dr. GRPO / DAPO with reward plugins, sampling with plyx-serve's engine.
"""

from typing import Any

__all__ = [
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
    "KTOExample",
    "PairExample",
    "PreferenceConfig",
    "PreferenceLoss",
    "PromptRecord",
    "RenderedChat",
    "RewardError",
    "RewardScores",
    "RewardSpec",
    "RunConfig",
    "RunResult",
    "SFTConfig",
    "SFTExample",
    "Task",
    "build_rewards",
    "collate_sft",
    "completion_rows",
    "corrupt",
    "default_beta",
    "dpo_loss",
    "greedy_answers",
    "group_advantages",
    "group_token_logps",
    "groups_token_logps",
    "grpo",
    "grpo_loss",
    "kto_loss",
    "load_chat_template",
    "load_tokenizer_and_template",
    "make_tasks",
    "orpo_loss",
    "pack_sft",
    "preference",
    "preference_metrics",
    "read_jsonl",
    "reward_components",
    "score",
    "score_completions",
    "sequence_logps",
    "sft",
    "simpo_loss",
    "split_of",
    "strip_generation_tags",
    "token_logps",
    "tokenize_kto",
    "tokenize_pairs",
    "tokenize_prompts",
    "tokenize_sft",
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
