"""``DistConfig``: the ``[dist]`` table of a ``TrainConfig`` (how a run is spread over processes).

Its own schema (``dist``, version 1) with its own migrations, nested in
``TrainConfig`` like ``ModelConfig``: documents written before the table
existed load unchanged (every field has a default), and a later change of the
table migrates ``[dist]`` alone.

The table is read only when the run is distributed (launched by
``plyx train --nproc N`` or ``torchrun``); a single-process run ignores it.
The strategy itself is implemented by a plugin (plyx-dist) through the
``plyx_train_strategy`` hook; plyx-train never imports it.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec
from plyx.specs.config._base import ConfigBase
from plyx.specs.errors import ConfigError

__all__ = ["DistConfig"]

Pos = Annotated[int, msgspec.Meta(ge=1)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]


class DistConfig(ConfigBase, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Data, fully sharded and tensor parallel training on torch.distributed."""

    SCHEMA = "dist"
    VERSION = 1

    strategy: Literal["ddp", "fsdp", "hsdp", "fsdp+tp"] = "ddp"
    """ddp (replicated weights, all-reduced gradients) | fsdp (FSDP2 ``fully_shard`` per block + root)
    | hsdp (FSDP within ``dp_shard`` ranks, replicated across ``dp_replicate`` groups)
    | fsdp+tp (FSDP over a 2-D mesh whose inner dimension is ``tp_size``-way tensor parallel)."""
    tp_size: Pos = 1
    """Tensor-parallel degree (fsdp+tp); must divide the world size and the model's heads."""
    dp_shard: NonNeg = 0
    """Ranks that shard the weights (fsdp/hsdp); 0 means all the data-parallel ranks (fsdp) or the
    ranks of one node (hsdp: LOCAL_WORLD_SIZE)."""
    dp_replicate: NonNeg = 0
    """Replica groups (hsdp); 0 means world_size / dp_shard."""
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """FSDP mixed precision: the dtype of the gathered weights and of the compute."""
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"
    """FSDP mixed precision: the dtype gradients are reduce-scattered in."""
    reshard_after_forward: bool = True
    """FSDP: free each block's gathered weights after its forward (less memory, one more all-gather)."""
    activation_checkpointing: Literal["none", "full", "every_2nd"] = "none"
    """Recompute blocks in the backward pass: none | full (every block) | every_2nd (every other block)."""
    meta_init: bool = True
    """fsdp/hsdp/fsdp+tp: build the model on the meta device and materialise only each rank's shard,
    one parameter at a time (a model larger than one rank's memory is buildable)."""
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend: auto (nccl on CUDA, gloo on CPU) | nccl | gloo."""
    timeout_s: Pos = 300
    """Process-group timeout: a collective that waits longer (a dead or stuck rank) fails the run."""
    async_save: bool = False
    """Write checkpoints with ``torch.distributed.checkpoint.async_save``: shards are staged to CPU memory
    and written in the background while training continues; the checkpoint is committed once written
    (plyx-dist >= 1.2; 1.1 refused true)."""

    def check(self) -> None:
        if self.strategy != "fsdp+tp" and self.tp_size != 1:
            raise ConfigError(
                "tp_size", f"tensor parallelism needs strategy = 'fsdp+tp' (strategy is {self.strategy!r})",
                value=self.tp_size, fix="set strategy = 'fsdp+tp' or tp_size = 1",
            )
        if self.strategy == "fsdp+tp" and self.tp_size < 2:
            raise ConfigError(
                "tp_size", "strategy 'fsdp+tp' needs a tensor-parallel degree of at least 2",
                value=self.tp_size, fix="set tp_size = 2 (or more), or use strategy = 'fsdp'",
            )
        if self.strategy != "hsdp" and self.dp_replicate not in (0, 1):
            raise ConfigError(
                "dp_replicate", f"replica groups need strategy = 'hsdp' (strategy is {self.strategy!r})",
                value=self.dp_replicate, fix="set strategy = 'hsdp' or leave dp_replicate at 0",
            )
        if self.strategy == "ddp" and (self.param_dtype != "float32" or self.reduce_dtype != "float32"):
            raise ConfigError(
                "param_dtype", "ddp keeps float32 weights; mixed precision of the weights is an FSDP policy",
                value=self.param_dtype, fix="use precision = 'bf16-autocast' with ddp, or strategy = 'fsdp'",
            )
