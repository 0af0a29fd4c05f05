"""The Trainer's one seam to distributed training: ask the ``plyx_train_strategy`` hook, or run alone.

plyx-train never imports plyx-dist (DESIGN.md): when the process was started by
a launcher (``WORLD_SIZE`` is set, as ``torchrun`` and ``plyx train --nproc N``
do) the Trainer asks the hook for a ``plyx.specs.TrainStrategy`` and calls it at
a few points of its loop. ``LocalStrategy`` is the single-process answer with
the same methods, so the loop has one shape either way.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from plyx.specs import ConfigError, TrainConfig, get_plugin_manager
from torch import nn

__all__ = ["LocalStrategy", "LAUNCH_VARIABLES", "resolve_strategy", "init_model"]

#: what torchrun exports to every rank; passed to the hook as ``environment``
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                    "GROUP_RANK", "TORCHELASTIC_RUN_ID")


def init_model(model: nn.Module, seed: int) -> nn.Module:
    """Give ``model`` the initial values of ``torch.manual_seed(seed); model.reset_parameters()``.

    The values then depend on the seed alone, not on what building the modules drew from the
    generator before, so a sharded build (plyx-dist: meta device, one shard per rank) reproduces
    them exactly. Models without ``reset_parameters`` keep their values.
    """
    reset = getattr(model, "reset_parameters", None)
    if callable(reset):
        torch.manual_seed(seed)
        reset()
    return model


class LocalStrategy:
    """One process, one device: the ``TrainStrategy`` a run without a launcher uses."""

    name = "local"
    sharded = False
    can_sample = True

    def __init__(self, rank: int = 0, world_size: int = 1, device: str = "cpu") -> None:
        self.rank = self.data_rank = rank
        self.world_size = self.data_world_size = world_size
        self.is_main = rank == 0
        self.device = device

    def build_model(self, build: Callable[[str], nn.Module], seed: int) -> nn.Module:
        return init_model(build(self.device), seed)

    def wrap(self, module: nn.Module) -> nn.Module:
        return module

    def micro_batch(self, model: nn.Module, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def loss(self, model: nn.Module, batch: Any, **options: float) -> None:
        return None

    def clip_grad_norm(self, parameters: Sequence[torch.Tensor], max_norm: float) -> float:
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def reduce_mean(self, values: Sequence[float]) -> list[float]:
        return [float(v) for v in values]

    def gather(self, value: float) -> list[float]:
        return [float(value)]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


def resolve_strategy(config: TrainConfig, environ: dict[str, str] | None = None) -> Any | None:
    """The plugin's strategy when a launcher started this process, None for a plain single-process run."""
    env = dict(os.environ if environ is None else environ)
    if "WORLD_SIZE" not in env:
        return None
    launch = {k: env[k] for k in LAUNCH_VARIABLES if k in env}
    strategy = get_plugin_manager().hook.plyx_train_strategy(config=config, environment=launch)
    if strategy is None:
        world = env.get("WORLD_SIZE", "?")
        if world == "1":
            return None  # `torchrun --nproc-per-node 1` without plyx-dist: an ordinary run
        raise ConfigError(
            "$.dist.strategy",
            f"this process was launched as one of WORLD_SIZE={world} ranks but no installed plugin provides a "
            f"training strategy (plyx_train_strategy)",
            value=config.dist.strategy,
            fix="pip install plyx-dist, or run without torchrun/--nproc",
        )
    return strategy
