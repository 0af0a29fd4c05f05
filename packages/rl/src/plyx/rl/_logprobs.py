"""Per-token and per-sequence log-probabilities of targets, through the kernel registry's ``linear_cross_entropy``.

``model(ids, return_hidden=True)`` gives the final hidden states ``[B, T, D]``; ``linear_cross_entropy``
with ``reduction="none"`` projects them through ``lm_head_weight`` chunk by chunk, so the ``[B T, V]``
logits never exist at once, and ``log p(target) = -CE``. Positions whose target is -100 get 0.
"""

from __future__ import annotations

from typing import Any

import plyx.kernel as kernels
import torch
from plyx.specs import Batch
from plyx.train import lce_operands
from torch import nn

__all__ = ["token_logps", "sequence_logps"]



def _unwrap(model: nn.Module) -> Any:
    """The module under ``torch.compile`` / DDP wrappers."""
    inner: Any = model
    while True:
        nxt = getattr(inner, "_orig_mod", None) or getattr(inner, "module", None)
        if nxt is None or not isinstance(nxt, nn.Module):
            return inner
        inner = nxt


def token_logps(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logps [B, T] float32, mask [B, T] bool)``: ``log p(targets[b, t] | ids[b, :t + 1])`` where a target exists.

    Args:
        model: a ``plyx.model.TransformerLM`` (adapters included).
        batch: ids, targets (-100 = none) and optionally ``document_ids`` / ``position_ids``.
    """
    hidden = model(batch.input_ids, position_ids=batch.position_ids, document_ids=batch.document_ids,
                   attention_mask=batch.attention_mask, return_hidden=True)  # (B, T, D)
    weight = _unwrap(model).lm_head_weight  # (V, D)
    B, T, D = hidden.shape
    flat, weight = lce_operands(hidden.reshape(B * T, D), weight)  # (B T, D)
    targets = batch.targets.to(hidden.device)
    ce = kernels.linear_cross_entropy(flat, weight, targets.reshape(-1), ignore_index=-100, reduction="none")
    mask = targets != -100
    logps = (-ce.float()).view(B, T).masked_fill(~mask, 0.0)  # (B, T)
    return logps, mask


def sequence_logps(model: nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum of target log-probs [B], target count [B])`` per row."""
    logps, mask = token_logps(model, batch)
    return logps.sum(-1), mask.sum(-1)
