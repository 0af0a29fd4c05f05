"""The language-modelling loss: final hidden states -> ``linear_cross_entropy`` kernel, never full logits.

``model(ids, return_hidden=True)`` gives ``[B, T, D]``; the registry's
``linear_cross_entropy`` projects it through ``model.lm_head_weight`` ``[V, D]``
chunk by chunk, so the ``[B T, V]`` logits never exist at once (at V = 128k,
B T = 16k that would be 8 GiB in float32).
"""

from __future__ import annotations

from typing import Any

import plyx.kernel as kernels
import torch
from plyx.specs import Batch
from torch import nn

__all__ = ["lm_loss", "linear_cross_entropy"]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         **options: Any) -> torch.Tensor:
    """Cross-entropy of ``hidden [N, D] @ weight[V, D].T`` against ``targets [N]``, by the kernel registry's choice.

    plyx-train declares its edge to plyx-kernel (workspace.toml) for exactly this call.
    """
    return kernels.linear_cross_entropy(hidden, weight, targets, **options)


def lm_loss(
    model: nn.Module, batch: Batch, *, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch`` over its targets that are not -100 (a 0-dim tensor), plus an
    MoE model's router losses of this forward (``model.router_aux_loss()``, weighted by ``ModelConfig.moe``)."""
    hidden = model(
        batch.input_ids,
        position_ids=batch.position_ids,
        document_ids=batch.document_ids,
        attention_mask=batch.attention_mask,
        return_hidden=True,
    )  # (B, T, D)
    weight = _unwrap(model).lm_head_weight  # (V, D)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (B T, D)
    dtype = _head_dtype(flat, weight)
    if flat.dtype != dtype:
        flat = flat.to(dtype)
    if weight.dtype != dtype:
        weight = weight.to(dtype)  # differentiable: the fp32 master weight gets its gradient through the cast
    loss = linear_cross_entropy(flat, weight, batch.targets.reshape(-1), ignore_index=-100,
                                label_smoothing=label_smoothing, z_loss=z_loss, reduction="mean")
    router = getattr(_unwrap(model), "router_aux_loss", None)  # MoE models: load-balancing + router z-loss
    aux = router() if router is not None else None
    return loss if aux is None else loss + aux


def _head_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The lm-head's compute dtype: autocast's where autocast is on (as ``nn.Linear`` would run it), else the
    weight's.

    The fused loss's matmuls run below autocast (``out=`` buffers, custom ops), so without this cast an fp32
    weight under bf16 autocast made the lm-head three full-fp32 GEMMs per step (issue 19: ~825 GFLOP per
    step at the 1B shape, batch 4 x 2048, at the fp32 rate instead of the bf16 tensor-core one).
    """
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def _unwrap(model: nn.Module) -> Any:
    """The module under ``torch.compile`` / DDP wrappers."""
    inner: Any = model
    while True:
        nxt = getattr(inner, "_orig_mod", None) or getattr(inner, "module", None)
        if nxt is None or not isinstance(nxt, nn.Module):
            return inner
        inner = nxt
