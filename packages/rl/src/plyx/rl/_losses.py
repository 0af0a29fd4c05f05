"""Preference losses, written from the papers, on sequence log-probabilities.

Every function takes per-sequence log-probs of the completions (summed over the
completion's tokens, or averaged where the method length-normalises) and returns
a ``PreferenceLoss``: the scalar to backpropagate, the per-example losses and the
implicit rewards TRL users read (``rewards/chosen``, ``rewards/rejected``...).

Notation: ``pi`` the policy, ``ref`` the frozen reference, ``y_w`` / ``y_l`` the
chosen / rejected completion, ``h = [log pi(y_w) - log ref(y_w)] - [log pi(y_l) - log ref(y_l)]``.

- DPO (Rafailov et al. 2023, eq. 7), ``sigmoid``: ``-log sigmoid(beta h)``.
- hinge (SLiC, Zhao et al. 2023): ``max(0, 1 - beta h)``.
- IPO (Azar et al. 2023, eq. 17): ``(h' - 1 / (2 beta))^2`` where ``h'`` uses log-ratios averaged over each
  completion's tokens (the IPO authors' normalisation, as TRL applies it).
- robust DPO (Chowdhury et al. 2024, eq. 8), label-flip rate ``eps``:
  ``[-(1 - eps) log sigmoid(beta h) + eps log sigmoid(-beta h)] / (1 - 2 eps)``.
- reference-free: the reference log-probs are taken as 0 (``h = log pi(y_w) - log pi(y_l)``).
- RPO (Pang et al. 2024): any of the above plus ``alpha`` x the chosen completions' mean token NLL.
- ORPO (Hong et al. 2024, eqs. 4-7): ``NLL(y_w) - beta log sigmoid(log odds(y_w) - log odds(y_l))`` with
  ``odds(y) = p / (1 - p)`` of the length-averaged log-prob ``log p``.
- SimPO (Meng et al. 2024, eq. 6): ``-log sigmoid(beta (avg log pi(y_w) - avg log pi(y_l)) - gamma)``.
- KTO (Ethayarajh et al. 2024, eq. 7): desirable ``w_d (1 - sigmoid(beta (r - z)))``, undesirable
  ``w_u (1 - sigmoid(beta (z - r)))``, ``r = log pi(y) - log ref(y)``, ``z = max(0, mean KL estimate)``
  (detached) from mismatched prompt/completion pairs.
"""

from __future__ import annotations

from typing import Literal

import attrs
import torch
import torch.nn.functional as F

__all__ = [
    "DPO_LOSS_TYPES",
    "PreferenceLoss",
    "dpo_loss",
    "kto_loss",
    "orpo_loss",
    "preference_metrics",
    "simpo_loss",
]

DpoLossType = Literal["sigmoid", "ipo", "hinge", "robust"]
DPO_LOSS_TYPES: tuple[str, ...] = ("sigmoid", "ipo", "hinge", "robust")


@attrs.frozen
class PreferenceLoss:
    """What a preference loss returns.

    Attributes:
        loss: the 0-dim tensor to backpropagate (the mean of ``losses``; KTO: the nan-mean over both kinds).
        losses: ``[B]`` per-example losses.
        chosen_rewards: ``[B_w]`` detached implicit rewards of the chosen (desirable) completions.
        rejected_rewards: ``[B_l]`` detached implicit rewards of the rejected (undesirable) completions.
        extra: further detached scalars (``kl``, ``log_odds_ratio``, ``nll_loss``).
    """

    loss: torch.Tensor
    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor
    extra: dict[str, float] = attrs.field(factory=dict)


def _check_beta(beta: float) -> None:
    if not beta > 0:
        raise ValueError(f"beta must be > 0 (got {beta}); DPO's usual range is 0.01-0.5, SimPO's 2-10")


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    loss_type: DpoLossType = "sigmoid",
    label_smoothing: float = 0.0,
    reference_free: bool = False,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    chosen_nll: torch.Tensor | None = None,
    rpo_alpha: float = 0.0,
) -> PreferenceLoss:
    """The DPO family on summed completion log-probs ``[B]``.

    Args:
        policy_chosen_logps, policy_rejected_logps: ``log pi(y_w | x)``, ``log pi(y_l | x)`` summed over tokens.
        ref_chosen_logps, ref_rejected_logps: the same under the reference (None with ``reference_free``).
        beta: the KL strength (DPO's beta; IPO's tau).
        loss_type: ``sigmoid`` | ``ipo`` | ``hinge`` | ``robust``.
        label_smoothing: ``robust``: the assumed rate of flipped labels, in ``[0, 0.5)``.
        reference_free: score against a uniform reference (ref log-probs = 0).
        chosen_lengths, rejected_lengths: ``[B]`` completion token counts (``ipo`` needs them).
        chosen_nll: 0-dim mean NLL of the chosen completions' tokens (needed when ``rpo_alpha > 0``).
        rpo_alpha: weight of ``chosen_nll`` added to the loss (RPO, Pang et al. 2024: DPO + NLL keeps the
            chosen completions likely; TRL's ``loss_type=[..., "sft"]``).

    Returns:
        ``PreferenceLoss`` with rewards ``beta * (log pi - log ref)``.
    """
    _check_beta(beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}; choose one of {', '.join(DPO_LOSS_TYPES)}")
    if reference_free or ref_chosen_logps is None or ref_rejected_logps is None:
        if not reference_free:
            raise ValueError("reference log-probs are missing; pass them or set reference_free=True")
        ref_chosen_logps = torch.zeros_like(policy_chosen_logps)
        ref_rejected_logps = torch.zeros_like(policy_rejected_logps)
    chosen_ratio = policy_chosen_logps - ref_chosen_logps  # log pi(y_w)/ref(y_w)
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * h)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        if chosen_lengths is None or rejected_lengths is None:
            raise ValueError("loss_type='ipo' averages log-ratios per token: pass chosen_lengths and rejected_lengths")
        h_avg = chosen_ratio / chosen_lengths.clamp(min=1) - rejected_ratio / rejected_lengths.clamp(min=1)
        losses = (h_avg - 1 / (2 * beta)) ** 2
    else:  # robust: unbiased under a label-flip rate eps (rDPO)
        eps = label_smoothing
        if not 0 <= eps < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5) for the robust loss (got {eps})")
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    loss = losses.mean()
    extra: dict[str, float] = {}
    if rpo_alpha > 0:
        if chosen_nll is None:
            raise ValueError("rpo_alpha > 0 adds the chosen completions' NLL: pass chosen_nll")
        loss = loss + rpo_alpha * chosen_nll
        extra["nll_loss"] = float(chosen_nll.detach())
    return PreferenceLoss(loss, losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach(), extra)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (Maechler 2012)."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def orpo_loss(
    policy_chosen_avg_logps: torch.Tensor,
    policy_rejected_avg_logps: torch.Tensor,
    chosen_nll: torch.Tensor,
    *,
    beta: float = 0.1,
) -> PreferenceLoss:
    """ORPO: the chosen completion's NLL plus the odds-ratio term, no reference model.

    Args:
        policy_chosen_avg_logps, policy_rejected_avg_logps: ``[B]`` log-probs averaged over completion tokens.
        chosen_nll: 0-dim mean next-token NLL of the chosen completions (the SFT term).
        beta: the odds-ratio weight (the paper's lambda).
    """
    _check_beta(beta)
    chosen = policy_chosen_avg_logps.float()
    rejected = policy_rejected_avg_logps.float()
    # log odds(y_w) - log odds(y_l), odds = p / (1 - p)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    losses = -beta * ratio
    loss = chosen_nll + losses.mean()
    extra = {"log_odds_ratio": float(ratio.mean().detach()), "log_odds_chosen": float(log_odds.mean().detach()),
             "nll_loss": float(chosen_nll.detach())}
    return PreferenceLoss(loss, losses, beta * chosen.detach(), beta * rejected.detach(), extra)


def simpo_loss(
    policy_chosen_avg_logps: torch.Tensor,
    policy_rejected_avg_logps: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 0.5,
    label_smoothing: float = 0.0,
) -> PreferenceLoss:
    """SimPO: length-normalised log-probs as the reward, a target margin ``gamma``, no reference.

    Args:
        policy_chosen_avg_logps, policy_rejected_avg_logps: ``[B]`` log-probs averaged over completion tokens.
        beta: the reward scale (the paper uses 2-10).
        gamma: the target reward margin (the paper's gamma, in reward units).
        label_smoothing: conservative variant (cDPO-style) with this flip rate; 0 is the paper's loss.
    """
    _check_beta(beta)
    z = beta * (policy_chosen_avg_logps - policy_rejected_avg_logps) - gamma
    losses = -F.logsigmoid(z) * (1 - label_smoothing) - F.logsigmoid(-z) * label_smoothing
    return PreferenceLoss(losses.mean(), losses, beta * policy_chosen_avg_logps.detach(),
                          beta * policy_rejected_avg_logps.detach())


def kto_loss(
    policy_logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    policy_kl_logps: torch.Tensor | None,
    ref_kl_logps: torch.Tensor | None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
) -> PreferenceLoss:
    """KTO on unpaired completions.

    Args:
        policy_logps, ref_logps: ``[B]`` summed completion log-probs under the policy and the reference.
        desirable: ``[B]`` bool, True for a desirable completion.
        policy_kl_logps, ref_kl_logps: ``[B]`` log-probs of mismatched (prompt, completion) pairs, whose mean
            log-ratio estimates KL(pi || ref); None uses z = 0.
        beta: the value function's scale.
        desirable_weight, undesirable_weight: ``lambda_D``, ``lambda_U`` (balance unequal counts).

    Returns:
        ``PreferenceLoss`` whose ``loss`` is the nan-mean of the weighted losses of both kinds.
    """
    _check_beta(beta)
    desirable = desirable.to(torch.bool)
    if policy_kl_logps is not None and ref_kl_logps is not None:
        z = (policy_kl_logps - ref_kl_logps).mean().detach().clamp(min=0)
    else:
        z = torch.zeros((), dtype=policy_logps.dtype, device=policy_logps.device)
    ratio = policy_logps - ref_logps
    chosen, rejected = ratio[desirable], ratio[~desirable]
    chosen_losses = 1 - torch.sigmoid(beta * (chosen - z))
    rejected_losses = 1 - torch.sigmoid(beta * (z - rejected))
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    return PreferenceLoss(losses.nanmean(), losses, beta * chosen.detach(), beta * rejected.detach(),
                          {"kl": float(z)})


def preference_metrics(out: PreferenceLoss, chosen_logps: torch.Tensor | None = None,
                       rejected_logps: torch.Tensor | None = None) -> dict[str, float]:
    """The metrics TRL logs: ``rewards/chosen|rejected|margins|accuracies`` and ``logps/chosen|rejected``.

    Margins and accuracies need paired rewards (DPO, ORPO, SimPO); KTO reports the margin of the means.
    """
    m: dict[str, float] = {"loss": float(out.loss.detach())}
    c, r = out.chosen_rewards.double(), out.rejected_rewards.double()
    if c.numel():
        m["rewards/chosen"] = float(c.mean())
    if r.numel():
        m["rewards/rejected"] = float(r.mean())
    if c.numel() and c.shape == r.shape:
        m["rewards/margins"] = float((c - r).mean())
        m["rewards/accuracies"] = float((c > r).double().mean())
    elif c.numel() and r.numel():
        m["rewards/margins"] = m["rewards/chosen"] - m["rewards/rejected"]
    if chosen_logps is not None and chosen_logps.numel():
        m["logps/chosen"] = float(chosen_logps.detach().double().mean())
    if rejected_logps is not None and rejected_logps.numel():
        m["logps/rejected"] = float(rejected_logps.detach().double().mean())
    m.update(out.extra)
    return m
