"""The language-modelling loss: final hidden states -> ``linear_cross_entropy`` kernel, never full logits.

``model(ids, return_hidden=True)`` gives ``[B, T, D]``; the registry's
``linear_cross_entropy`` projects it through ``model.lm_head_weight`` ``[V, D]``
chunk by chunk, so the ``[B T, V]`` logits never exist at once (at V = 128k,
B T = 16k that would be 8 GiB in float32).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from plyx.specs import Batch
from torch import nn

__all__ = ["lm_loss", "linear_cross_entropy"]


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         **options: Any) -> torch.Tensor:
    """Cross-entropy of ``hidden [N, D] @ weight[V, D].T`` against ``targets [N]``, by the kernel registry's choice.

    plyx-model re-exports the registry's ``linear_cross_entropy`` dispatcher as
    ``plyx.model.linear_cross_entropy`` when it has one. Until then it is taken from plyx-kernel,
    which plyx-model depends on (so it is always installed with plyx-train); the import is by
    name so that plyx-train declares no edge to plyx-kernel that DESIGN's graph does not have.
    """
    model_api = importlib.import_module("plyx.model")
    fn = getattr(model_api, "linear_cross_entropy", None)
    if fn is None:
        fn = importlib.import_module("plyx.kernel").linear_cross_entropy
    return fn(hidden, weight, targets, **options)  # type: ignore[no-any-return]


def lm_loss(
    model: nn.Module, batch: Batch, *, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> torch.Tensor:
    """Mean next-token cross-entropy of ``batch`` over its targets that are not -100 (a 0-dim tensor)."""
    hidden = model(
        batch.input_ids,
        position_ids=batch.position_ids,
        document_ids=batch.document_ids,
        attention_mask=batch.attention_mask,
        return_hidden=True,
    )  # (B, T, D)
    weight = _unwrap(model).lm_head_weight  # (V, D)
    flat = hidden.reshape(-1, hidden.shape[-1])  # (B T, D)
    if flat.dtype != weight.dtype:  # under autocast the hidden states may be bf16 while weights stay fp32
        flat = flat.to(weight.dtype)
    return linear_cross_entropy(flat, weight, batch.targets.reshape(-1), ignore_index=-100,
                                label_smoothing=label_smoothing, z_loss=z_loss, reduction="mean")


def _unwrap(model: nn.Module) -> Any:
    """The module under ``torch.compile`` / DDP wrappers."""
    inner: Any = model
    while True:
        nxt = getattr(inner, "_orig_mod", None) or getattr(inner, "module", None)
        if nxt is None or not isinstance(nxt, nn.Module):
            return inner
        inner = nxt
