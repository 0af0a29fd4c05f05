"""A third-party reward plugin: plyx-rl's GRPO finds these reward functions through ``plyx_reward_functions``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from plyx.specs import Component, hookimpl

#: the contract versions this plugin was written against
plyx_contracts = {"hooks": "1.0"}

RewardFn = Callable[..., list[float | None]]


def contains_answer(**_: Any) -> RewardFn:
    """1.0 when the record's ``answer`` occurs in the completion, 0.0 when not, None without an answer."""
    def reward(prompts: list[str], completions: list[str], answer: list[Any] | None = None,
               **columns: Any) -> list[float | None]:
        answers = answer if answer is not None else [None] * len(completions)
        return [None if a is None else float(str(a) in c) for c, a in zip(completions, answers)]

    return reward


def digit_ratio(*, scale: float = 1.0) -> RewardFn:
    """``scale`` x the share of the completion's characters that are digits (0 for an empty completion)."""
    def reward(prompts: list[str], completions: list[str], **columns: Any) -> list[float | None]:
        return [scale * sum(ch.isdigit() for ch in c) / len(c) if c else 0.0 for c in completions]

    return reward


@hookimpl
def plyx_reward_functions() -> list[Component]:
    return [Component("contains_answer", contains_answer, "1 when the answer occurs in the completion (example)"),
            Component("digit_ratio", digit_ratio, "share of digit characters x scale (example)")]
