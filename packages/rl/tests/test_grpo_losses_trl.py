"""Parity of the GRPO, Dr. GRPO and DAPO losses with TRL 1.16's ``GRPOTrainer._compute_loss`` (the oracle).

TRL computes the loss inside ``GRPOTrainer._compute_loss(model, inputs)``, after a model forward
(``_get_per_token_logps_and_entropies``). We build the trainer without ``__init__`` (``object.__new__``),
set only the attributes the loss path reads, and make that forward return the per-token log-probs we choose:
a ``[B, T]`` float64 leaf. Our ``grpo_loss`` gets the same leaf; both gradients land on it and are compared.
Old log-probs (mu > 1 inner steps) and reference log-probs come in as TRL's precomputed inputs.
Advantages are checked against TRL's ``nanstd`` (the function its trainer normalises groups with).
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from plyx.rl import group_advantages, grpo_loss  # noqa: E402

B, T = 6, 9


class _Accel(SimpleNamespace):
    device = torch.device("cpu")
    num_processes = 1

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather

    @staticmethod
    def reduce(x, reduction="sum"):
        return x


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) < 0.75).to(torch.int64)
    mask[:, 0] = 1
    logps = (-2 * torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    # old / ref log-probs near the policy's so some ratios fall inside and some outside the clip range
    old = (logps.detach() + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64))
    ref = (logps.detach() + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64))
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    return logps, mask, old, ref, adv


def _trl_loss(loss_type, beta, eps_low, eps_high, logps, mask, old, ref, adv, max_len):
    from trl.trainer.grpo_trainer import GRPOTrainer

    t = object.__new__(GRPOTrainer)
    model = SimpleNamespace(training=True)
    t.__dict__.update(
        model=model, accelerator=_Accel(), loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
        importance_sampling_level="token", top_entropy_quantile=1.0, off_policy_mask_threshold=None, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1, max_completion_length=max_len,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
    )
    # the "forward": our log-probs, zero entropies
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask, "advantages": adv,
              "old_per_token_logps": old, "num_items_in_batch": mask.sum()}
    if beta != 0:
        inputs["ref_per_token_logps"] = ref
    loss = t._compute_loss(model, inputs)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("beta,eps_low,eps_high,use_old", [
    (0.0, 0.2, 0.2, False),   # mu = 1: ratio 1, no KL
    (0.04, 0.2, 0.2, True),   # mu > 1 inner step: ratios clipped, k3 KL
    (0.1, 0.2, 0.28, True),   # clip-higher (DAPO's eps_high)
])
def test_grpo_losses_match_trl(loss_type, beta, eps_low, eps_high, use_old):
    logps, mask, old, ref, adv = _tensors(seed=hash((loss_type, beta, eps_high)) % 1000)
    max_len = T + 3  # dr_grpo's constant normaliser differs from the padded width
    trl_old = old if use_old else logps.detach()
    expected, metrics = _trl_loss(loss_type, beta, eps_low, eps_high, logps, mask, trl_old, ref, adv, max_len)
    (g_trl,) = torch.autograd.grad(expected, logps)
    out = grpo_loss(logps, adv, mask, old_logps=old if use_old else None, ref_logps=ref if beta else None,
                    loss_type=loss_type, beta=beta, epsilon_low=eps_low, epsilon_high=eps_high,
                    max_completion_length=max_len)
    (g_ours,) = torch.autograd.grad(out.loss, logps)
    torch.testing.assert_close(out.loss, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_ours, g_trl, rtol=1e-12, atol=1e-12)
    assert out.clip_fraction == pytest.approx(metrics["clip_ratio/region_mean"], abs=1e-6)  # TRL averages in float32
    assert out.clip_low == pytest.approx(metrics["clip_ratio/low_mean"], abs=1e-6)  # TRL averages in float32
    assert out.clip_high == pytest.approx(metrics["clip_ratio/high_mean"], abs=1e-6)  # TRL averages in float32
    if beta:
        assert out.kl == pytest.approx(metrics["kl"], rel=1e-6)
    if use_old:
        assert out.clip_fraction > 0  # the case exercises the clipped branch


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_the_full_batch(loss_type):
    """A batch split in micro-batches with the batch's normalisers gives the full-batch loss and gradient."""
    logps, mask, old, ref, adv = _tensors(seed=7)
    kw = {"old_logps": old, "ref_logps": ref, "loss_type": loss_type, "beta": 0.05, "max_completion_length": T}
    full = grpo_loss(logps, adv, mask, **kw).loss
    (g_full,) = torch.autograd.grad(full, logps)
    parts = sum(grpo_loss(logps[s], adv[s], mask[s], num_sequences=B, num_tokens=int(mask.sum()),
                          **{**kw, "old_logps": old[s], "ref_logps": ref[s]}).loss
                for s in (slice(0, 2), slice(2, 6)))
    (g_parts,) = torch.autograd.grad(parts, logps)
    torch.testing.assert_close(parts, full, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g_parts, g_full, rtol=1e-12, atol=1e-12)


def test_group_advantages_match_trls_normalisation():
    from trl.trainer.utils import nanstd

    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (4 * 5,), generator=g).double()
    rewards[5:10] = 1.0  # an all-equal group
    rewards[12] = float("nan")  # a sample no reward scored
    adv, std = group_advantages(rewards, 5)
    grouped = rewards.view(-1, 5)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(5)
    trl_std = nanstd(grouped, dim=1).repeat_interleave(5)
    expected = torch.nan_to_num((rewards - mean) / (trl_std + 1e-4), nan=0.0)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(std.repeat_interleave(5), trl_std)
    assert torch.all(adv[5:10] == 0) and adv[12] == 0
    unscaled, _ = group_advantages(rewards, 5, scale=False)  # Dr. GRPO: r - mean
    torch.testing.assert_close(unscaled, torch.nan_to_num(rewards - mean, nan=0.0))
