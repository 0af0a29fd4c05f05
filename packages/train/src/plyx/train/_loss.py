"""The language-modelling loss: final hidden states -> ``linear_cross_entropy`` kernel, never full logits.

``model(ids, return_hidden=True)`` gives ``[B, T, D]``; the registry's
``linear_cross_entropy`` projects it through ``model.lm_head_weight`` ``[V, D]``
chunk by chunk, so the ``[B T, V]`` logits never exist at once (at V = 128k,
B T = 16k that would be 8 GiB in float32).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from plyx.specs import Batch

__all__ = ["lm_loss", "linear_cross_entropy_fn"]


def linear_cross_entropy_fn(*tensors: torch.Tensor, **shape: int) -> Callable[..., torch.Tensor]:
    """The ``linear_cross_entropy`` implementation the kernel registry selects for these tensors.

    plyx-model exposes the registry's choice as ``plyx.model.linear_cross_entropy_fn`` when it
    has one; otherwise the registry of plyx-kernel (installed with plyx-model) is asked directly.
    """
    model_api = importlib.import_module("plyx.model")
    helper = getattr(model_api, "linear_cross_entropy_fn", None)
    if helper is not None:
        return helper(*tensors, **shape)  # type: ignore[no-any-return]
    kernel = importlib.import_module("plyx.kernel")  # a dependency of plyx-model, always present with it
    return kernel.registry().get("linear_cross_entropy", *tensors, **shape)  # type: ignore[no-any-return]


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
    fn = linear_cross_entropy_fn(flat, weight)
    return fn(flat, weight, batch.targets.reshape(-1), ignore_index=-100, label_smoothing=label_smoothing,
              z_loss=z_loss, reduction="mean")


def _unwrap(model: nn.Module) -> Any:
    """The module under ``torch.compile`` / DDP wrappers."""
    inner: Any = model
    while True:
        nxt = getattr(inner, "_orig_mod", None) or getattr(inner, "module", None)
        if nxt is None or not isinstance(nxt, nn.Module):
            return inner
        inner = nxt
