"""plyx-rl: post-training for plyx models: SFT and preference optimisation (DPO family, ORPO, SimPO, KTO).

Python API: ``sft(SFTConfig(...))``, ``preference(PreferenceConfig(method="dpo", ...))``; the losses
(``dpo_loss``, ``orpo_loss``, ``simpo_loss``, ``kto_loss``) work on any sequence log-probs; chat templates
(``ChatTemplate``, ``load_chat_template``) render with Hugging Face ``apply_chat_template`` semantics;
``make_tasks`` generates verifiable tasks with a fixed held-out split.
"""

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
from plyx.rl._run import RunResult, load_tokenizer_and_template, preference, sft
from plyx.rl._tasks import TASK_KINDS, Task, corrupt, greedy_answers, make_tasks, score, split_of

__all__ = [
    "DPO_LOSS_TYPES",
    "TASK_KINDS",
    "AdapterSettings",
    "ChatTemplate",
    "ChatTemplateError",
    "DataError",
    "DataReport",
    "KTOExample",
    "PairExample",
    "PreferenceConfig",
    "PreferenceLoss",
    "RenderedChat",
    "RunConfig",
    "RunResult",
    "SFTConfig",
    "SFTExample",
    "Task",
    "collate_sft",
    "completion_rows",
    "corrupt",
    "default_beta",
    "dpo_loss",
    "greedy_answers",
    "kto_loss",
    "load_chat_template",
    "load_tokenizer_and_template",
    "make_tasks",
    "orpo_loss",
    "pack_sft",
    "preference",
    "preference_metrics",
    "read_jsonl",
    "score",
    "sequence_logps",
    "sft",
    "simpo_loss",
    "split_of",
    "strip_generation_tags",
    "tokenize_kto",
    "tokenize_pairs",
    "tokenize_sft",
    "token_logps",
]
