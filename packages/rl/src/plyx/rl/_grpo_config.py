"""``GRPOConfig``: the run configuration of ``plyx rl grpo`` (strict, versioned; TOML, JSON or YAML).

Example (TOML)::

    model = "runs/sft/model"
    data = "prompts.jsonl"          # {"prompt": [{"role": "user", "content": "add 2 3"}], "answer": "5"}
    out_dir = "runs/grpo"
    loss_type = "dapo"
    num_generations = 8
    batch_size = 4                  # prompts per step (x num_generations completions)
    steps = 100

    [[rewards]]
    name = "exact_match"

    [[rewards]]
    name = "regex_format"
    weight = 0.2
    args = { pattern = '\\d+' }
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from plyx.rl._config import RunConfig
from plyx.specs import OptimizerConfig, ScheduleConfig

__all__ = ["GRPOConfig", "RewardSpec", "effective_grpo"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0)]


class RewardSpec(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """One reward function of the run (a ``plyx_reward_functions`` component)."""

    name: str
    """The component's name: exact_match | numeric_match | regex_format | length_penalty | reward_model | a plugin's."""
    weight: float = 1.0
    """Its weight in the summed reward."""
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    """Keyword arguments of its factory (e.g. ``{pattern = '\\d+'}`` for regex_format)."""
    label: str = ""
    """The name in metrics (``rewards/<label>/mean``); empty: ``name``."""


class GRPOConfig(RunConfig, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """``plyx rl grpo``: group relative policy optimisation with verifiable rewards.

    ``batch_size`` counts prompts per step (each sampled ``num_generations`` times); ``steps`` counts
    generation rounds, each followed by ``num_iterations`` optimizer updates on its samples.
    """

    SCHEMA = "rl.grpo"
    VERSION = 1

    optimizer: OptimizerConfig = msgspec.field(default_factory=lambda: OptimizerConfig(lr=1e-6, weight_decay=0.0))
    """Optimizer (a ``plyx_optimizers`` plugin); RL learning rates are small (TRL's default 1e-6)."""
    schedule: ScheduleConfig = msgspec.field(default_factory=lambda: ScheduleConfig(kind="constant", warmup_steps=0))
    """Learning-rate schedule over ``steps x num_iterations`` updates."""
    batch_size: Pos = 4
    """Prompts per step."""
    loss_type: Literal["grpo", "dr_grpo", "dapo"] = "grpo"
    """grpo (per-sequence mean) | dr_grpo (no std scaling, constant normaliser) | dapo (token-level, clip-higher,
    dynamic sampling)."""
    num_generations: Annotated[int, msgspec.Meta(ge=2)] = 8
    """G: completions per prompt."""
    max_new_tokens: Pos = 64
    """Longest completion (also dr_grpo's constant normaliser)."""
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """Sampling temperature (> 0: the group needs different completions)."""
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling."""
    beta: NonNegFloat = 0.0
    """Weight of the k3 KL to the reference (the starting model); 0: no reference model is kept."""
    epsilon: NonNegFloat = 0.2
    """Clip range below 1 (eps_low), and above 1 unless epsilon_high is set."""
    epsilon_high: NonNegFloat | None = None
    """Clip range above 1 (DAPO's clip-higher); None: epsilon (dapo: 0.28)."""
    num_iterations: Pos = 1
    """mu: optimizer updates per generation round (> 1: the importance ratio against the sampling policy)."""
    scale_rewards: bool | None = None
    """Divide advantages by the group's reward std; None: True for grpo and dapo, False for dr_grpo."""
    dynamic_sampling: bool | None = None
    """Drop groups whose rewards are all equal and sample more prompts to fill the batch; None: on for dapo."""
    max_sampling_rounds: Pos = 3
    """Dynamic sampling: generation rounds per step at most (then the step trains on what it has)."""
    rewards: tuple[RewardSpec, ...] = (RewardSpec(name="exact_match"),)
    """The reward functions (summed with their weights)."""
    accuracy_reward: str = "exact_match"
    """The reward (label) whose mean is logged as ``accuracy``; empty: none."""
    share_prompt: bool | None = None
    """Log-prob pass: compute each prompt once and attend its G completions to the prompt's keys and values
    (True), or run every group's ``prompt + completion`` rows in one batch (False); None: shared on CPU, batched
    on CUDA, where the shared pass measured slower (``plyx.rl.share_prompt_default``)."""
    micro_batch_groups: Pos = 4
    """Groups per forward/backward of the training pass (gradients accumulate over the step's groups)."""
    max_nan_steps: Pos = 3
    """Stop after this many consecutive updates whose loss is not finite (each is skipped and named)."""
    save_every: NonNeg = 0
    """Steps between resumable checkpoints in out_dir/state (0: only at the end); ``--resume`` continues there."""
    engine_block_size: Pos = 16
    """Tokens per KV block of the sampling engine."""
    engine_max_batch_size: Pos = 64
    """Most sequences the engine decodes at once."""
    engine_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """The engine's weights: auto = bfloat16 on CUDA, float32 on CPU (the policy trains in float32)."""


def effective_grpo(config: GRPOConfig) -> dict[str, Any]:
    """The loss-type-dependent defaults resolved: eps_high, scale_rewards, dynamic_sampling."""
    dapo = config.loss_type == "dapo"
    return {
        "epsilon_high": config.epsilon_high if config.epsilon_high is not None else (0.28 if dapo else config.epsilon),
        "scale_rewards": config.scale_rewards if config.scale_rewards is not None else config.loss_type != "dr_grpo",
        "dynamic_sampling": config.dynamic_sampling if config.dynamic_sampling is not None else dapo,
    }
