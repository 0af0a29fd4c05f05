"""GRPO's objective and advantages, written from the papers, on per-token log-probabilities.

Notation, for a group of G completions o_1..o_G of one prompt q with rewards r_1..r_G:

- advantage (Shao et al. 2024, DeepSeekMath, eq. 4 outcome supervision): ``A_i = (r_i - mean(r)) / (std(r) + eps)``,
  the same for every token of o_i; Dr. GRPO (Liu et al. 2025) drops the std division (``scale=False``).
  ``std`` is the unbiased (n - 1) sample std; rewards that are None (NaN here) are left out of the group's
  mean and std and get advantage 0.
- importance ratio of token t: ``rho_t = exp(log pi(o_t) - log pi_old(o_t))``; ``pi_old`` is the policy that
  sampled the group. With one update per group (mu = 1) ``pi_old = pi`` numerically (``rho = 1``, gradient
  ``A grad log pi``); with mu > 1 inner steps ``pi_old`` stays the sampling policy.
- clipped surrogate (PPO): ``l_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A)``; DAPO's
  clip-higher (Yu et al. 2025) sets ``eps_high > eps_low``.
- KL to the reference, k3 estimator (Schulman 2020): ``k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1``
  (non-negative, unbiased for KL(pi || ref)); the token loss becomes ``l_t + beta k3_t``.
- aggregation (the three variants):
  ``grpo``: mean over each sequence's tokens, then mean over sequences;
  ``dr_grpo``: sum over all tokens / (number of sequences x max_completion_length), a constant;
  ``dapo``: token-level, sum over all tokens / number of tokens of the whole generation batch.

``num_sequences`` / ``num_tokens`` let a micro-batch of a larger batch use the batch's normaliser, so the
sum of micro-batch losses is exactly the full-batch loss (gradient accumulation without reweighting).
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch

__all__ = ["GRPO_LOSS_TYPES", "GRPOLoss", "group_advantages", "grpo_loss"]

GrpoLossType = Literal["grpo", "dr_grpo", "dapo"]
GRPO_LOSS_TYPES: tuple[str, ...] = ("grpo", "dr_grpo", "dapo")


@attrs.frozen
class GRPOLoss:
    """What ``grpo_loss`` returns.

    Attributes:
        loss: the 0-dim tensor to backpropagate.
        kl: detached mean k3 KL over the completion tokens (0 when beta is 0 and no reference was given).
        clip_low: share of tokens whose ratio fell below ``1 - eps_low`` with a negative advantage (clipped).
        clip_high: share of tokens whose ratio rose above ``1 + eps_high`` with a positive advantage.
        clip_fraction: ``clip_low + clip_high`` (TRL's ``clip_ratio/region_mean``).
        tokens: completion tokens in this batch.
    """

    loss: torch.Tensor
    kl: float
    clip_low: float
    clip_high: float
    clip_fraction: float
    tokens: int


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: bool = True, eps: float = 1e-4
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Group-normalised advantages of rewards laid out group after group.

    Args:
        rewards: ``[N]`` float, ``N = groups x group_size``, consecutive ``group_size`` rows share a prompt;
            NaN marks a sample no reward scored (left out of its group's statistics, advantage 0).
        group_size: G.
        scale: divide by the group's std (+ eps); False is Dr. GRPO's unscaled ``r - mean``.
        eps: added to the std (TRL's 1e-4).

    Returns:
        ``(advantages [N], group_std [N // G])``; a group whose std is 0 (all rewards equal) has advantage 0 on
        every sample: it carries no learning signal (DAPO drops such groups).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [groups x group_size] (got shape {list(rewards.shape)} for group_size "
                         f"{group_size}); pass one reward per completion, groups consecutive")
    grouped = rewards.double().view(-1, group_size)  # (groups, G)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)  # (groups, 1)
    count = (~grouped.isnan()).sum(dim=1, keepdim=True)
    var = torch.nanmean((grouped - mean) ** 2, dim=1, keepdim=True) * count / (count - 1).clamp(min=1)
    std = torch.where(count > 1, var.sqrt(), torch.zeros_like(var))  # one scored sample: no spread
    adv = grouped - mean
    if scale:
        adv = adv / (std + eps)
    adv = torch.nan_to_num(adv, nan=0.0)  # unscored samples (and all-unscored groups) move nothing
    adv = torch.where(std > 0, adv, torch.zeros_like(adv))  # all-equal groups: exactly 0 (no rounding residue)
    return adv.view(-1).to(rewards.dtype), std.view(-1).to(rewards.dtype)


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
              loss_type: GrpoLossType = "grpo", beta: float = 0.0, epsilon_low: float = 0.2,
              epsilon_high: float | None = None, max_completion_length: int | None = None,
              num_sequences: int | None = None, num_tokens: int | None = None) -> GRPOLoss:
    """The clipped policy-gradient loss of GRPO, Dr. GRPO or DAPO (see the module docstring for the formulas).

    Args:
        logps: ``[B, T]`` the policy's log-probs of the completion tokens (with gradients).
        advantages: ``[B]`` one advantage per completion.
        mask: ``[B, T]`` 1 on completion tokens, 0 on padding.
        old_logps: ``[B, T]`` log-probs under the sampling policy (mu > 1 inner steps); None: ``logps`` detached.
        ref_logps: ``[B, T]`` the reference's log-probs; needed when ``beta > 0``.
        loss_type: grpo | dr_grpo | dapo.
        beta: weight of the k3 KL term (0: none).
        epsilon_low, epsilon_high: the clip range ``[1 - eps_low, 1 + eps_high]``; eps_high None = eps_low.
        max_completion_length: dr_grpo's constant normaliser (default: T).
        num_sequences: sequences of the whole batch this micro-batch belongs to (grpo, dr_grpo; default B).
        num_tokens: completion tokens of the whole batch (dapo; default: this batch's).

    Returns:
        ``GRPOLoss``.
    """
    if loss_type not in GRPO_LOSS_TYPES:
        raise ValueError(f"unknown GRPO loss_type {loss_type!r}; choose from {', '.join(GRPO_LOSS_TYPES)}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's log-probs); pass them or set beta = 0")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    mask_f = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    adv = advantages.to(logps.dtype)[:, None]  # (B, 1): one advantage for every token of a completion
    ratio = torch.exp(logps - old)  # (B, T)
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (B, T)
    kl_mean = 0.0
    if ref_logps is not None:
        delta = ref_logps - logps
        k3 = torch.exp(delta) - delta - 1  # (B, T)
        kl_mean = float((k3.detach() * mask_f).sum() / mask_f.sum().clamp(min=1))
        if beta > 0:
            per_token = per_token + beta * k3
    B, T = logps.shape
    n_seq = B if num_sequences is None else num_sequences
    if loss_type == "grpo":
        loss = ((per_token * mask_f).sum(-1) / mask_f.sum(-1).clamp(min=1)).sum() / n_seq
    elif loss_type == "dr_grpo":
        loss = (per_token * mask_f).sum() / (n_seq * (max_completion_length or T))
    else:  # dapo: every token of the batch weighs the same
        n_tok = mask_f.sum().clamp(min=1) if num_tokens is None else max(int(num_tokens), 1)
        loss = (per_token * mask_f).sum() / n_tok
    with torch.no_grad():
        n = mask_f.sum().clamp(min=1)
        low = float((((ratio < 1 - epsilon_low) & (adv < 0)).to(mask_f.dtype) * mask_f).sum() / n)
        high = float((((ratio > 1 + eps_high) & (adv > 0)).to(mask_f.dtype) * mask_f).sum() / n)
    return GRPOLoss(loss=loss, kl=kl_mean, clip_low=low, clip_high=high, clip_fraction=low + high,
                    tokens=int(mask.sum()))
