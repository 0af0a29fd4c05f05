"""The built-in plugin of plyx-dist, registered under the `plyx` entry-point group.

Answers ``plyx_train_strategy`` (DDP, FSDP2, HSDP, FSDP + TP for plyx-train's Trainer) and adds
``plyx dist consolidate`` (``plyx_cli_commands``). Imports torch only when a hook is called.
"""

from __future__ import annotations

from typing import Any

from plyx.specs import CliCommand, hookimpl
from plyx.specs.components import deferred

plyx_contracts = {"hooks": "1.0", "checkpoint": "1.0"}


@hookimpl
def plyx_train_strategy(config: Any, environment: dict[str, str]) -> Any:
    from plyx.dist._strategy import DistStrategy

    return DistStrategy(config, environment)


@hookimpl
def plyx_cli_commands() -> list[Any]:
    # deferred: the command module loads when `plyx dist` runs, not for `plyx --help`
    return [CliCommand("dist", "distributed training: consolidate sharded checkpoints",
                       deferred("plyx.dist._cli:configure"), deferred("plyx.dist._cli:run"))]
