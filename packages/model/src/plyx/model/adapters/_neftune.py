"""NEFTune (Jain et al. 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning").

In train mode, uniform noise is added to the input embeddings::

    e' = e + U(-1, 1) * alpha / sqrt(L * d)          e: [B, L, d]

with ``L`` the sequence length of the batch and ``d`` the embedding width (the same scaling as
``transformers``' ``neftune_noise_alpha``). In eval mode the embeddings are untouched.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from plyx.model.adapters._errors import AdapterError
from torch import nn

__all__ = ["NEFTune", "neftune"]


class NEFTune:
    """A registered NEFTune hook: ``remove()`` it, or use it as a context manager.

    Attributes:
        alpha: the noise scale. module: the embedding it is attached to.
    """

    def __init__(self, module: nn.Module, alpha: float) -> None:
        self.module, self.alpha = module, alpha
        self._handle = module.register_forward_hook(self._hook)

    def _hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training:
            return None  # output unchanged
        L, d = output.shape[-2], output.shape[-1]  # (B, L, d)
        bound = self.alpha / math.sqrt(L * d)
        return output + torch.empty_like(output).uniform_(-bound, bound)

    def remove(self) -> None:
        """Detach the hook (idempotent)."""
        self._handle.remove()

    def __enter__(self) -> NEFTune:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def neftune(model: nn.Module, alpha: float) -> NEFTune:
    """Add NEFTune noise to ``model``'s input embeddings (``embed_tokens``) while it is in train mode.

    Args:
        model: a ``TransformerLM`` (or any module with an ``embed_tokens`` embedding).
        alpha: the noise scale (the paper uses 5, 10 or 15); > 0.

    Returns:
        a handle: ``handle.remove()`` or ``with neftune(model, 5.0): ...`` stops the noise.

    Example::

        with neftune(model, alpha=5.0):
            loss = train_step(model.train(), batch)
    """
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0 or not math.isfinite(alpha):
        raise AdapterError(f"neftune alpha must be a finite number > 0 (got {alpha!r}); the paper uses 5, 10 or 15")
    embed = getattr(model, "embed_tokens", None)
    if not isinstance(embed, nn.Embedding):
        raise AdapterError(
            f"neftune needs a model with an `embed_tokens` nn.Embedding (got {type(model).__name__}"
            f"{'' if embed is None else f' whose embed_tokens is {type(embed).__name__}'}); pass the TransformerLM itself, "
            f"not a wrapper (DDP's .module, torch.compile's ._orig_mod)"
        )
    return NEFTune(embed, float(alpha))
