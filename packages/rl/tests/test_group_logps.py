"""Prompt-KV sharing in the policy's log-prob pass: the prompt computed once and attended by its G completions
gives the values and gradients of the plain per-completion pass."""

from __future__ import annotations

import pytest
import torch
from plyx.rl import group_token_logps, groups_token_logps

from ._grpo_fixtures import tiny_model


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10),  # exact up to summation order
                                       (torch.float32, 2e-5)])   # float32 rounding of a 2-layer model
def test_shared_prompt_matches_the_unshared_pass(dtype, tol):
    model = tiny_model(3, n_layers=2).to(dtype)
    prompt = list(range(40, 71))  # 31 tokens
    completions = [[5, 6, 7, 8, 9], [10, 11], [12], [13, 14, 15, 16, 17, 18, 19]]  # ragged, right-padded
    a, mask_a = group_token_logps(model, prompt, completions, pad=0, share_prompt=True)
    ga = torch.autograd.grad((a * torch.linspace(0.5, 1.5, a.numel()).view_as(a)).sum(), list(model.parameters()))
    b, mask_b = group_token_logps(model, prompt, completions, pad=0, share_prompt=False)
    gb = torch.autograd.grad((b * torch.linspace(0.5, 1.5, b.numel()).view_as(b)).sum(), list(model.parameters()))
    assert torch.equal(mask_a, mask_b) and mask_a.sum() == 15
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert torch.all(a[~mask_a] == 0)
    for (name, _), x, y in zip(model.named_parameters(), ga, gb):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol, msg=name)


def test_several_groups_and_one_token_completions():
    model = tiny_model(4).double()
    prompts = [[1, 2, 3], list(range(20, 45))]
    comps = [[7], [8], [9, 10], [11], [12, 13, 14], [15], [16], [17]]  # G = 4
    a, ma = groups_token_logps(model, prompts, comps, 4, pad=0, share_prompt=True)
    b, mb = groups_token_logps(model, prompts, comps, 4, pad=0, share_prompt=False)
    torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    assert a.shape == (8, 3) and torch.equal(ma, mb)
