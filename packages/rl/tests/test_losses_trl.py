"""Parity of every preference loss with TRL (the oracle), values and gradients w.r.t. the policy log-probs.

TRL 1.16 keeps DPO's and KTO's losses inside ``DPOTrainer._compute_loss`` / ``KTOTrainer._compute_loss``,
which run a model forward. We build the trainer object without ``__init__`` (``object.__new__``), set only
the attributes the loss path reads, and pass a stand-in "model" whose output carries the per-token
log-probs we choose (``log_probs``, plus the zero ``entropy`` / ``mean_logits`` / ``is_top1`` its metric
code reads). The reference log-probs come in as precomputed inputs, exactly TRL's cached-reference mode.
ORPO's ``odds_ratio_loss`` and CPO's ``cpo_loss`` (SimPO) are plain instance methods: called on a bare
object with ``beta``, ``accelerator`` and the loss-type attributes set.

The policy log-probs are a per-token ``[2B, T]`` float64 leaf; our functions get their masked sums (or
means), TRL gets the tensor itself; both gradients land on that leaf and are compared.
"""

from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

trl = pytest.importorskip("trl")
from plyx.rl import dpo_loss, kto_loss, orpo_loss, preference_metrics, simpo_loss  # noqa: E402

B, T = 5, 7


class _Accel(SimpleNamespace):
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


class _StandIn:
    """Callable 'model': returns the per-token log-probs it was given, in TRL's output fields."""

    training = True

    def __init__(self, per_token: torch.Tensor) -> None:
        self.per_token = per_token

    def __call__(self, **_: object) -> SimpleNamespace:
        z = torch.zeros_like(self.per_token)
        return SimpleNamespace(log_probs=self.per_token, entropy=z, mean_logits=z, is_top1=z.bool(), aux_loss=None)


def _tokens(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(rows, T, generator=g) < 0.8).to(torch.int64)
    mask[:, 0] = 1  # every completion has a token
    logps = (-3 * torch.rand(rows, T, generator=g, dtype=torch.float64)) * mask  # TRL zeroes non-completion logps
    return logps.requires_grad_(True), mask


def _trl_dpo(loss_type: str, beta: float, label_smoothing: float, per_token, mask, ref_c, ref_r, *,
             extra_types=(), extra_weights=()):
    from trl.trainer.dpo_trainer import DPOTrainer

    t = object.__new__(DPOTrainer)
    stand_in = _StandIn(per_token)
    t.__dict__.update(model=stand_in, accelerator=_Accel(), precompute_ref_logps=True, loss_types=[loss_type, *extra_types],
                      loss_weights=[1.0, *extra_weights], ld_alpha=None, f_divergence_type="reverse_kl", beta=beta,
                      label_smoothing=label_smoothing, use_weighting=False, aux_loss_enabled=False,
                      _metrics={"train": defaultdict(list), "eval": defaultdict(list)}, _total_train_tokens=0,
                      _tp_size=1)
    # TRL's completion_mask covers the whole sequence and shifts it by one; prepend the (prompt) column 0
    full_mask = torch.cat([torch.zeros(2 * B, 1, dtype=mask.dtype), mask], dim=1)
    inputs = {"input_ids": torch.zeros(2 * B, T + 1, dtype=torch.long), "attention_mask": torch.ones(2 * B, T + 1),
              "completion_mask": full_mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = t._compute_loss(stand_in, inputs, return_outputs=False)
    return loss, {k: v[-1] for k, v in t._metrics["train"].items()}


@pytest.mark.parametrize("loss_type,label_smoothing", [("sigmoid", 0.0), ("hinge", 0.0), ("ipo", 0.0),
                                                       ("robust", 0.0), ("robust", 0.2)])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_dpo_losses_match_trl(loss_type, label_smoothing, beta):
    per_token, mask = _tokens(1, 2 * B)
    g = torch.Generator().manual_seed(2)
    ref = -8 * torch.rand(2 * B, generator=g, dtype=torch.float64)
    ref_c, ref_r = ref[:B], ref[B:]

    want, trl_metrics = _trl_dpo(loss_type, beta, label_smoothing, per_token, mask, ref_c, ref_r)
    (want_grad,) = torch.autograd.grad(want, per_token)

    logps = per_token.sum(-1)
    lengths = mask.sum(-1).to(torch.float64)
    out = dpo_loss(logps[:B], logps[B:], ref_c, ref_r, beta=beta, loss_type=loss_type,
                   label_smoothing=label_smoothing, chosen_lengths=lengths[:B], rejected_lengths=lengths[B:])
    (got_grad,) = torch.autograd.grad(out.loss, per_token)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    ours = preference_metrics(out, logps[:B], logps[B:])
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen",
                "logps/rejected"):
        # TRL averages the accuracies as float32 (``.float().mean()``)
        rel = 1e-7 if key == "rewards/accuracies" else 1e-9
        assert ours[key] == pytest.approx(trl_metrics[key], rel=rel, abs=1e-12), key


def test_reference_free_dpo_is_trl_dpo_against_a_zero_reference():
    """TRL 1.16 has no reference_free switch; its definition (older TRL, Zephyr) is ref log-probs = 0."""
    per_token, mask = _tokens(3, 2 * B)
    zeros = torch.zeros(B, dtype=torch.float64)
    want, _ = _trl_dpo("sigmoid", 0.1, 0.0, per_token, mask, zeros, zeros)
    (want_grad,) = torch.autograd.grad(want, per_token)
    logps = per_token.sum(-1)
    out = dpo_loss(logps[:B], logps[B:], None, None, beta=0.1, reference_free=True)
    (got_grad,) = torch.autograd.grad(out.loss, per_token)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_rpo_is_trl_dpo_plus_its_sft_loss_type(alpha):
    """TRL 1.16 composes losses: loss_type=["sigmoid", "sft"], loss_weights=[1, alpha] is RPO."""
    per_token, mask = _tokens(8, 2 * B)
    g = torch.Generator().manual_seed(9)
    ref = -8 * torch.rand(2 * B, generator=g, dtype=torch.float64)
    want, trl_metrics = _trl_dpo("sigmoid", 0.1, 0.0, per_token, mask, ref[:B], ref[B:], extra_types=("sft",),
                                 extra_weights=(alpha,))
    (want_grad,) = torch.autograd.grad(want, per_token)
    logps = per_token.sum(-1)
    nll = -(per_token[:B] * mask[:B]).sum() / mask[:B].sum()  # masked tokens only, as token_logps gives them
    out = dpo_loss(logps[:B], logps[B:], ref[:B], ref[B:], beta=0.1, chosen_nll=nll, rpo_alpha=alpha)
    (got_grad,) = torch.autograd.grad(out.loss, per_token)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


def _means(per_token, mask):
    return per_token.sum(-1) / mask.sum(-1)


@pytest.mark.parametrize("beta,gamma,label_smoothing", [(2.0, 0.5, 0.0), (10.0, 1.6, 0.0), (2.5, 0.3, 0.1)])
def test_simpo_matches_trl_cpo_simpo(beta, gamma, label_smoothing):
    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    per_token, mask = _tokens(4, 2 * B)
    avg = _means(per_token, mask)  # CPOTrainer length-normalises for SimPO (average_log_prob)
    t = object.__new__(CPOTrainer)
    t.__dict__.update(alpha=0.0, beta=beta, simpo_gamma=gamma, loss_type="simpo", label_smoothing=label_smoothing,
                      accelerator=_Accel())
    losses, c_rew, r_rew = t.cpo_loss(avg[:B], avg[B:])
    want = losses.mean()
    (want_grad,) = torch.autograd.grad(want, per_token)

    out = simpo_loss(_means(per_token, mask)[:B], _means(per_token, mask)[B:], beta=beta, gamma=gamma,
                     label_smoothing=label_smoothing)
    (got_grad,) = torch.autograd.grad(out.loss, per_token)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(out.chosen_rewards, c_rew)
    torch.testing.assert_close(out.rejected_rewards, r_rew)


@pytest.mark.parametrize("beta", [0.1, 0.25])
def test_orpo_matches_trl_odds_ratio_loss(beta):
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer

    per_token, mask = _tokens(5, 2 * B)
    per_token = per_token.detach().mul(0.3).requires_grad_(True)  # average log-probs near 0 too (p -> 1 side)
    nll = -(per_token[:B].sum() / mask[:B].sum())  # the SFT term: mean NLL of the chosen tokens
    avg = _means(per_token, mask)
    t = object.__new__(ORPOTrainer)
    t.__dict__.update(beta=beta, accelerator=_Accel())
    losses, c_rew, r_rew, ratio, log_odds = t.odds_ratio_loss(avg[:B], avg[B:])
    want = nll - losses.mean()  # ORPOTrainer.get_batch_loss_metrics: policy_nll_loss - losses.mean()
    (want_grad,) = torch.autograd.grad(want, per_token, retain_graph=True)

    out = orpo_loss(avg[:B], avg[B:], nll, beta=beta)
    (got_grad,) = torch.autograd.grad(out.loss, per_token)
    # odds_ratio_loss casts to float32 first (``.float()``): float32 tolerances
    torch.testing.assert_close(out.loss.double(), want.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)
    assert out.extra["log_odds_ratio"] == pytest.approx(float(ratio.detach()), rel=1e-6)
    assert out.extra["log_odds_chosen"] == pytest.approx(float(log_odds.detach()), rel=1e-6)


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 1.33), (0.7, 1.0)])
@pytest.mark.parametrize("with_kl", [True, False])
def test_kto_matches_trl(weights, with_kl):
    from trl.trainer.kto_trainer import KTOTrainer

    rows = 2 * B
    per_token, mask = _tokens(6, rows)
    g = torch.Generator().manual_seed(7)
    labels = torch.tensor([True, False, True, True, False, False, True, False, True, True])
    ref = -8 * torch.rand(rows, generator=g, dtype=torch.float64)
    kl_policy = -8 * torch.rand(rows, generator=g, dtype=torch.float64)
    kl_ref = kl_policy - 0.5 * torch.rand(rows, generator=g, dtype=torch.float64)  # a positive KL estimate

    t = object.__new__(KTOTrainer)
    stand_in = _StandIn(per_token)
    t.__dict__.update(model=stand_in, accelerator=_Accel(), precompute_ref_logps=True, calculate_KL=with_kl,
                      loss_type="kto", beta=0.1, desirable_weight=weights[0], undesirable_weight=weights[1],
                      aux_loss_enabled=False, _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
                      _total_train_tokens=0, _tp_size=1)
    t._compute_kl_logps = lambda model, batch: kl_policy if with_kl else None  # the mismatched-pair forward
    full_mask = torch.cat([torch.zeros(rows, 1, dtype=mask.dtype), mask], dim=1)
    inputs = {"input_ids": torch.zeros(rows, T + 1, dtype=torch.long), "attention_mask": torch.ones(rows, T + 1),
              "completion_mask": full_mask, "label": labels, "ref_logps": ref, "ref_KL_logps": kl_ref}
    want = t._compute_loss(stand_in, inputs, return_outputs=False)
    (want_grad,) = torch.autograd.grad(want, per_token)

    out = kto_loss(per_token.sum(-1), ref, labels, kl_policy if with_kl else None, kl_ref if with_kl else None,
                   beta=0.1, desirable_weight=weights[0], undesirable_weight=weights[1])
    (got_grad,) = torch.autograd.grad(out.loss, per_token)
    torch.testing.assert_close(out.loss, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)
    metrics = t._metrics["train"]
    ours = preference_metrics(out)
    assert ours["kl"] == pytest.approx(metrics["kl"][-1], rel=1e-9, abs=1e-12)
    assert ours["rewards/chosen"] == pytest.approx(metrics["rewards/chosen"][-1], rel=1e-9)
    assert ours["rewards/rejected"] == pytest.approx(metrics["rewards/rejected"][-1], rel=1e-9)
    assert ours["rewards/margins"] == pytest.approx(metrics["rewards/margins"][-1], rel=1e-9)


def test_losses_reject_bad_arguments():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(x, x, x, x, loss_type="sigmod")
    with pytest.raises(ValueError, match="reference_free"):
        dpo_loss(x, x, None, None)
    with pytest.raises(ValueError, match="chosen_lengths"):
        dpo_loss(x, x, x, x, loss_type="ipo")
    with pytest.raises(ValueError, match="label_smoothing"):
        dpo_loss(x, x, x, x, loss_type="robust", label_smoothing=0.5)
    with pytest.raises(ValueError, match="beta"):
        simpo_loss(x, x, beta=0.0)
