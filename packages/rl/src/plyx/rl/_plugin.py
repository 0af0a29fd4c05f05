"""The built-in plugin of plyx-rl, registered under the `plyx` entry-point group.

Provides the ``plyx rl sft|dpo|orpo|simpo|kto|grpo|distill|rm|judge`` command (``plyx_cli_commands``) and the
built-in reward functions of GRPO (``plyx_reward_functions``).
"""

from __future__ import annotations

from typing import Any

from plyx.specs import CliCommand, Component, hookimpl
from plyx.specs.components import deferred

plyx_contracts = {"hooks": "1.0", "batch": "1.0"}


@hookimpl
def plyx_cli_commands() -> list[Any]:
    # deferred: the command module loads when `plyx rl` runs, not for `plyx --help`
    return [CliCommand("rl", "post-train a model: sft, dpo, orpo, simpo, kto, grpo, distill, rm; rank models: judge",
                       deferred("plyx.rl._cli:configure_rl"), deferred("plyx.rl._cli:run_rl"))]


@hookimpl
def plyx_reward_functions() -> list[Any]:
    # deferred: plyx.rl._rewards (and the reward model's torch code) load when a run builds its rewards
    return [
        Component("exact_match", deferred("plyx.rl._rewards:exact_match"),
                  "1 when the completion equals the record's answer (the task generator's check)"),
        Component("numeric_match", deferred("plyx.rl._rewards:numeric_match"),
                  "1 when the completion's last number equals the answer (within tolerance)"),
        Component("regex_format", deferred("plyx.rl._rewards:regex_format"),
                  "reward when a regular expression matches the completion, else penalty"),
        Component("length_penalty", deferred("plyx.rl._rewards:length_penalty"),
                  "DAPO's soft overlong punishment (0 .. -1 over the last `cache` tokens before max_length)"),
        Component("reward_model", deferred("plyx.rl._rewards:reward_model"),
                  "scores of a trained Bradley-Terry reward model (plyx.rl._reward_model)"),
    ]
