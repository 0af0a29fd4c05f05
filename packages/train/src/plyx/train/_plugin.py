"""The built-in plugin of plyx-train, registered under the `plyx` entry-point group.

Provides the ``adamw``, ``sgd``, ``adamw8bit`` and ``adafactor`` optimizers (``plyx_optimizers``) and the
``plyx train`` / ``plyx data`` commands (``plyx_cli_commands``).
"""

from __future__ import annotations

from typing import Any

from plyx.specs import CliCommand, Component, hookimpl
from plyx.specs.components import deferred

plyx_contracts = {"hooks": "1.0", "batch": "1.0", "checkpoint": "1.0"}


@hookimpl
def plyx_optimizers() -> list[Any]:
    from plyx.train._adamw8bit import adamw8bit
    from plyx.train._optim import adafactor, adamw, sgd

    return [
        Component("adamw", adamw, "AdamW with decoupled weight decay; torch's fused kernel on CPU and CUDA"),
        Component("sgd", sgd, "SGD with Nesterov momentum betas[0]; fused where torch has it"),
        Component("adamw8bit", adamw8bit, "AdamW with 8-bit block-wise quantised moments (~4x less state)"),
        Component("adafactor", adafactor, "torch.optim.Adafactor: factored second moment, no first moment "
                  "(row + column statistics per matrix); lr ~1e-2 is a relative step"),
    ]


@hookimpl
def plyx_cli_commands() -> list[Any]:
    # deferred: the command module (and the config schemas it reads) loads when `plyx train`/`plyx data` runs,
    # not for `plyx --help`
    return [
        CliCommand("train", "train a model (no CONFIG: a small model on the bundled Tiny Shakespeare)",
                   deferred("plyx.train._cli:configure_train"), deferred("plyx.train._cli:run_train")),
        CliCommand("data", "prepare a corpus: tokenizer + memory-mapped token shards",
                   deferred("plyx.train._cli:configure_data"), deferred("plyx.train._cli:run_data")),
    ]
