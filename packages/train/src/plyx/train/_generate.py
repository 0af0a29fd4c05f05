"""Sample text from a model during training: a plain temperature / top-k loop over the full forward.

No KV cache (that is plyx-serve's business); each new token re-runs the model
on the last ``max_seq_len`` tokens, which is fine for the few hundred tokens
of an evaluation sample.
"""

from __future__ import annotations

import torch
from plyx.train._loss import _unwrap
from torch import nn

__all__ = ["generate_ids"]


@torch.no_grad()
def generate_ids(
    model: nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    *,
    temperature: float = 0.8,
    top_k: int | None = 50,
    generator: torch.Generator | None = None,
) -> list[int]:
    """``prompt`` followed by ``max_new_tokens`` sampled ids (greedy when ``temperature`` is 0).

    Uses its own ``generator`` so sampling never moves the training RNG
    (an exact resume would otherwise depend on when samples were printed).
    """
    inner = _unwrap(model)
    device = inner.lm_head_weight.device
    window = int(inner.config.max_seq_len)
    ids = torch.tensor([prompt or [0]], dtype=torch.long, device=device)  # (1, T)
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            hidden = inner(ids[:, -window:], return_hidden=True)[:, -1]  # (1, D)
            logits = (hidden.float() @ inner.lm_head_weight.float().T)  # (1, V)
            if temperature <= 0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None and top_k < logits.shape[-1]:
                    kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
            ids = torch.cat([ids, nxt], dim=1)
    finally:
        model.train(was_training)
    return ids[0].tolist()
