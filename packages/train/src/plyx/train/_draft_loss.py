"""The draft heads' training losses, as the papers define them, on the frozen base's hidden states.

Medusa-1 (Cai et al. 2024, eq. 1): head k (k = 1..K) reads the base's last hidden state ``h_t`` and is
trained on token ``x_{t+k+1}``::

    L = sum_k lambda_k * CE(head_k(h_t), x_{t+k+1}),   lambda_k = decay ** k  (the paper: 0.8 ** k)

EAGLE (Li et al. 2024, §4.2): the draft predicts ``f̂_{t+1}`` from ``[embed(x_{t+1}); f_t]``::

    L_reg = SmoothL1(f_{t+1}, f̂_{t+1})                          (mean over D, then over positions)
    L_cls = CrossEntropy(p_{t+2}, p̂_{t+2}),  p = softmax(LMHead(f_{t+1})), p̂ = softmax(LMHead(f̂_{t+1}))
    L     = L_reg + w_cls * L_cls                                 (the paper: w_cls = 0.1)

With ``teacher_logits`` Medusa's heads are self-distilled (the paper's §2.3.2): head k's target is the base's
own distribution at position t+k (soft cross-entropy), so the heads learn what the base will say, which is
what verification accepts, rather than the corpus. The EAGLE cross-entropy is against the base's distribution over token t+2 (soft labels through the frozen LM
head), as the paper writes it and its code computes it. Top-1 accuracy of a head is how often its argmax
equals the token it is trained on (Medusa) or the base's argmax (EAGLE: what greedy verification accepts).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "eagle_loss", "medusa_loss"]

IGNORE_INDEX = -100


def medusa_loss(head_logits: torch.Tensor, targets: torch.Tensor, *, decay: float = 0.8,
                document_ids: torch.Tensor | None = None, teacher_logits: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Medusa-1's weighted sum of per-head cross-entropies.

    Args:
        head_logits: ``[K, B, T, V]``: ``head_logits[k - 1, :, t]`` scores token ``x_{t+k+1}``.
        targets: ``[B, T]`` next tokens ``y_t = x_{t+1}`` (``-100``: no loss), as a ``Batch`` carries them;
            head k's label at position t is then ``y_{t+k}``.
        decay: lambda_k = decay ** k.
        document_ids: ``[B, T]`` packed documents: a label from another document than position t is masked.
        teacher_logits: ``[B, T, V]`` the base's own logits: self-distillation (Medusa §2.3.2) -- head k at
            t is trained on the base's distribution at position t+k (soft cross-entropy) instead of the
            data's token; accuracy is then agreement with the base's argmax (what greedy verification accepts).

    Returns:
        ``(loss, accuracy)``: the 0-dim loss and each head's top-1 accuracy (0-dim tensors, no grad).
    """
    K, B, T, V = head_logits.shape
    loss = head_logits.new_zeros(())
    accuracy: list[torch.Tensor] = []
    for k in range(1, K + 1):
        if k >= T:  # no position has a label this far ahead
            accuracy.append(head_logits.new_zeros(()))
            continue
        logits = head_logits[k - 1, :, : T - k]  # (B, T - k, V): positions t = 0..T-k-1
        labels = targets[:, k:].clone()  # (B, T - k): y_{t+k} = x_{t+k+1}
        if document_ids is not None:
            labels[document_ids[:, : T - k] != document_ids[:, k:]] = IGNORE_INDEX
        valid = labels != IGNORE_INDEX
        if not bool(valid.any()):
            accuracy.append(head_logits.new_zeros(()))
            continue
        if teacher_logits is None:
            ce = F.cross_entropy(_wide(logits).reshape(-1, V), labels.reshape(-1), ignore_index=IGNORE_INDEX)
            hit = logits.argmax(dim=-1) == labels
        else:
            teacher = _wide(teacher_logits[:, k:].detach())  # (B, T - k, V): the base's p at position t+k
            per = -(teacher.softmax(dim=-1) * _wide(logits).log_softmax(dim=-1)).sum(dim=-1)  # (B, T - k)
            ce = per[valid].mean()
            hit = logits.argmax(dim=-1) == teacher.argmax(dim=-1)
        loss = loss + decay ** k * ce
        with torch.no_grad():
            accuracy.append(hit[valid].float().mean())
    return loss, accuracy


def eagle_loss(predicted: torch.Tensor, features: torch.Tensor, lm_head_weight: torch.Tensor, *,
               cls_weight: float = 0.1, mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """EAGLE's feature regression plus token cross-entropy through the frozen LM head.

    Args:
        predicted: ``[B, N, D]`` the draft's ``f̂_{t+1}`` (from ``[embed(x_{t+1}); f_t]``).
        features: ``[B, N, D]`` the base's ``f_{t+1}`` (the regression target; no gradient flows into it).
        lm_head_weight: the base's ``[V, D]`` LM head (frozen).
        cls_weight: w_cls.
        mask: ``[B, N]`` True where the position counts (same document, real token); default all.

    Returns:
        ``(loss, parts)``: the 0-dim loss and ``{"reg", "cls", "accuracy"}`` (0-dim, detached).
    """
    target = _wide(features.detach())
    pred = _wide(predicted)
    weight = _wide(lm_head_weight.detach())
    if mask is None:
        mask = torch.ones(pred.shape[:2], dtype=torch.bool, device=pred.device)
    m = mask.float()
    count = m.sum().clamp(min=1)
    reg = (F.smooth_l1_loss(pred, target, reduction="none").mean(dim=-1) * m).sum() / count  # mean over D, positions
    with torch.no_grad():
        target_logits = target @ weight.t()  # (B, N, V)
        target_p = target_logits.softmax(dim=-1)
    pred_logits = pred @ weight.t()  # (B, N, V)
    cls = (-(target_p * pred_logits.log_softmax(dim=-1)).sum(dim=-1) * m).sum() / count
    loss = reg + cls_weight * cls
    with torch.no_grad():
        hit = (pred_logits.argmax(dim=-1) == target_logits.argmax(dim=-1)).float()
        accuracy = (hit * m).sum() / count
    return loss, {"reg": reg.detach(), "cls": cls.detach(), "accuracy": accuracy}


def _wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32 (bf16 hidden states and logits are widened for the loss; float64 stays float64)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))
