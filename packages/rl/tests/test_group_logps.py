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


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the Triton flash attention's backward with "
                    "queries fewer than keys)")
def test_shared_prompt_matches_on_cuda_under_bf16_autocast():
    model = tiny_model(5, d_model=64, n_layers=2).cuda()
    prompt = list(range(3, 300))
    completions = [list(range(10 + g, 30 + g)) for g in range(8)]
    grads = []
    outs = []
    for share in (True, False):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, mask = group_token_logps(model, prompt, completions, pad=0, share_prompt=share)
        lp.sum().backward()
        outs.append(lp.detach())
        grads.append([p.grad.clone() for p in model.parameters()])
    # bf16 rounding of two different association orders: compare at bf16's resolution
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2)
    for x, y in zip(*grads):
        torch.testing.assert_close(x, y, rtol=5e-2, atol=5e-3 * float(y.abs().max()) + 1e-6)
