"""The built-in plugin of plyx-rl, registered under the `plyx` entry-point group.

Provides the ``plyx rl sft|dpo|orpo|simpo|kto|distill|rm|judge`` command (``plyx_cli_commands``).
"""

from __future__ import annotations

from typing import Any

from plyx.specs import CliCommand, hookimpl
from plyx.specs.components import deferred

plyx_contracts = {"hooks": "1.0", "batch": "1.0"}


@hookimpl
def plyx_cli_commands() -> list[Any]:
    # deferred: the command module loads when `plyx rl` runs, not for `plyx --help`
    return [CliCommand("rl", "post-train a model: sft, dpo, orpo, simpo, kto, distill, rm; rank models: judge",
                       deferred("plyx.rl._cli:configure_rl"), deferred("plyx.rl._cli:run_rl"))]
