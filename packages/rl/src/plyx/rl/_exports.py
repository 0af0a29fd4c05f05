"""The public names of ``plyx.rl``, imported on first use by its ``__getattr__`` (keeps the package light)."""
# re-exports: plyx.rl.__all__ names them and its __getattr__ serves them
# ruff: noqa: F401

from plyx.rl._chat import ChatTemplate, ChatTemplateError, RenderedChat, load_chat_template, strip_generation_tags
from plyx.rl._config import AdapterSettings, PreferenceConfig, RunConfig, SFTConfig, default_beta
from plyx.rl._data import (
    DataError,
    DataReport,
    KTOExample,
    PairExample,
    SFTExample,
    collate_sft,
    completion_rows,
    pack_sft,
    read_jsonl,
    tokenize_kto,
    tokenize_pairs,
    tokenize_sft,
)
from plyx.rl._distill import DISTILL_LOSSES, DistillLossError, distill_loss, distill_loss_logits, token_divergence
from plyx.rl._distill_run import DistillConfig, distill
from plyx.rl._group_logps import GradKVCache, group_token_logps, groups_token_logps, share_prompt_default
from plyx.rl._grpo import PromptRecord, grpo, tokenize_prompts
from plyx.rl._grpo_config import GRPOConfig, RewardSpec
from plyx.rl._grpo_losses import GRPO_LOSS_TYPES, GRPOLoss, group_advantages, grpo_loss
from plyx.rl._judge import JudgeRanking, Verdict, collect_verdicts, position_bias, rank_models, read_verdicts
from plyx.rl._logprobs import sequence_logps, token_logps
from plyx.rl._losses import (
    DPO_LOSS_TYPES,
    PreferenceLoss,
    dpo_loss,
    kto_loss,
    orpo_loss,
    preference_metrics,
    simpo_loss,
)
from plyx.rl._reward_model import (
    RewardModel,
    RewardModelConfig,
    bradley_terry_loss,
    load_reward_model,
    reward_model_reward,
    train_reward_model,
)
from plyx.rl._rewards import RewardError, RewardScores, build_rewards, reward_components, score_completions
from plyx.rl._run import RunResult, load_tokenizer_and_template, preference, sft
from plyx.rl._tasks import TASK_KINDS, Task, corrupt, greedy_answers, make_tasks, score, split_of
