"""Parallelism applied to a single-device ``TransformerLM`` from outside (torchtitan's ``parallelize.py``).

Order matters and follows torchtitan: tensor parallelism first (DTensor plans on
each block), then activation checkpointing, then FSDP2 (``fully_shard`` per block,
the LM head under TP, then the root), so FSDP shards the TP-sharded weights along
the data-parallel dimension of the 2-D mesh.

TP plan (Megatron-LM's, as ``parallelize_module`` expresses it)::

    attention: q/k/v colwise (heads split over tp ranks), o rowwise (partial sums all-reduced)
    mlp:       gate/up colwise (the hidden dim split),     down rowwise
    lm_head:   colwise with Shard(-1) logits -> cross-entropy under ``loss_parallel`` (vocab split)

The model's attention reshapes with its own head counts, so each block is told the
local counts (``n_heads / tp``), as torchtitan does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

__all__ = ["apply_tp", "apply_activation_checkpointing", "apply_fsdp", "materialize"]


def apply_tp(model: nn.Module, tp_mesh: Any) -> None:
    """Megatron-style column/row plans on every block and a vocab-parallel LM head."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    for block in model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(),
        }
        parallelize_module(block, tp_mesh, plan)
        attn = block.self_attn
        attn.n_heads //= tp  # local heads: q/k/v outputs are this rank's heads only
        attn.n_kv_heads //= tp
    parallelize_module(model, tp_mesh, {
        "lm_head": ColwiseParallel(input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False),
    })


def apply_activation_checkpointing(model: nn.Module, mode: str) -> int:
    """Recompute ``full`` (every) or ``every_2nd`` block in the backward pass; returns how many.

    The block's ``forward`` is wrapped in place (not a wrapper module), so parameter names and
    checkpoints are unchanged.
    """
    from torch.utils.checkpoint import checkpoint

    if mode == "none":
        return 0
    count = 0
    for i, block in enumerate(model.layers):
        if mode == "every_2nd" and i % 2:
            continue
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)  # type: ignore[method-assign]
        count += 1
    return count


def apply_fsdp(model: nn.Module, mesh: Any, *, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool, shard_head: bool) -> None:
    """``fully_shard`` each block, the LM head when it runs as its own module (TP), then the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for i, block in enumerate(model.layers):
        # the last block's weights are needed again at once by the backward: keep them gathered
        last = i == len(model.layers) - 1
        fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward and not last)
    if shard_head and getattr(model, "lm_head", None) is not None:
        fully_shard(model.lm_head, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)


class _Shadow:
    """Stands in for the model inside its own ``reset_parameters``: hands out full tensors one at a time."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.config = getattr(model, "config", None)
        self._model, self._device = model, device

    def named_parameters(self) -> Any:
        for name, p in self._model.named_parameters():
            full = torch.empty(p.shape, dtype=p.dtype, device=self._device)  # the global shape of a DTensor
            yield name, full  # the model's rule fills it (normal_, fill_, zero_)
            _copy_shard(p, full)
            del full


def _copy_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        if isinstance(param, DTensor):
            # src_data_rank=None: every rank holds the same full tensor and slices its own shard, no traffic
            local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
            param.to_local().copy_(local)
        else:
            param.copy_(full)


def materialize(model: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate a meta-built (and sharded) model on ``device`` and give it its initial values.

    The values are those of ``torch.manual_seed(seed); model.reset_parameters()`` on one device
    (``plyx.train.init_model``): the model's own rule runs over full-size tensors handed out one
    parameter at a time, and each rank keeps its shard, so peak memory is one full parameter.
    """
    if any(True for _ in model.buffers()):
        raise ValueError(
            f"{type(model).__name__} has buffers, which a meta-device build leaves uninitialised; set "
            f"dist.meta_init = false"
        )
    model.to_empty(device=device)
    reset = getattr(type(model), "reset_parameters", None)
    if reset is None:
        raise ValueError(f"{type(model).__name__} has no reset_parameters(); set dist.meta_init = false")
    torch.manual_seed(seed)
    reset(_Shadow(model, device))  # type: ignore[arg-type]
